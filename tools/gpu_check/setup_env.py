"""Stage "environment": what the machine is, and Laya made importable on it without the
network or a build.

    python tools/gpu_check/setup_env.py SITE WHEELS

1. The carried wheels (tools/gpu_check/prepare_wheels.sh) go into SITE with pip, no index
   and no dependencies, except those whose distribution the machine already has at a
   version that meets WHEELS/requirements.txt (the machine's own torch, numpy ... stay) and
   those built for another Python (counted, and said in the stage's reason).
2. The source tree is installed as an editable install would be, without setuptools: for
   the core and each plugin folder, a ``NAME-VERSION.dist-info`` in SITE with its metadata
   and entry points (read from its pyproject.toml), so ``importlib.metadata`` finds the
   ``laya`` plugins, and its folder on PYTHONPATH. tools/gpu_check.sh sources the
   ``export PYTHONPATH=...`` line this writes to SITE/env.sh (with the GPU's architecture
   for CUDA compiles, TORCH_CUDA_ARCH_LIST).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import common
import memory_probe

# The distributions installed from the tree: the core, and the plugins the stages use.
TREE = ("", "plugins/backend_torch", "plugins/backend_exl2")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted_specs(wheels: Path) -> dict[str, str]:
    """requirements.txt beside the wheels: canonical name -> its requirement line."""
    path = wheels / "requirements.txt"
    if not path.is_file():
        return {}
    lines = [ln.split("#")[0].strip() for ln in path.read_text().splitlines()]
    return {canonical(re.split(r"[<>=!~;\[ ]", ln)[0]): ln for ln in lines if ln}


def already_met(name: str, spec: str | None) -> bool:
    """Whether the machine has distribution ``name``, at a version meeting ``spec``."""
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        return False
    if spec is None:
        return True
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return True
    return Requirement(spec).specifier.contains(version, prereleases=True)


def fits_this_python(wheel: Path) -> bool:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    return bool(set(parse_wheel_filename(wheel.name)[3]) & set(sys_tags()))


def install_wheels(site: Path, wheels: Path) -> dict[str, Any]:
    specs = wanted_specs(wheels)
    chosen, kept, foreign = [], [], []
    for wheel in sorted(wheels.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        if already_met(name, specs.get(name)):
            kept.append(wheel)
        elif fits_this_python(wheel):
            chosen.append(wheel)
        else:
            foreign.append(wheel)
    if chosen:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                        "--no-deps", "--no-compile", "--upgrade", "--target", str(site),
                        *map(str, chosen)], check=True)
    return {"installed": [w.name for w in chosen], "machine_has": [w.name for w in kept],
            "not_for_this_python": [w.name for w in foreign]}


def write_dist_info(site: Path, folder: Path) -> tuple[str, str] | None:
    """A dist-info for the pyproject.toml in ``folder``: (name, version), or None without
    one (a plugin folder not in this tree)."""
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    shutil.rmtree(info, ignore_errors=True)
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
                   for group, entries in groups.items())
    (info / "entry_points.txt").write_text(text)
    (info / "INSTALLER").write_text("tools/gpu_check\n")
    return name, version


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                           "machine": platform.machine(), "cpus": _cpus(),
                           "memory_gib": _meminfo_gib()}
    for dist in ("torch", "transformers", "tokenizers", "safetensors", "nanobind",
                 "scikit-build-core", "ninja", "cmake", "accelerate", "pytest", "httpx"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if env["cuda_available"]:
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory
                                          / 2**30, 1)
    except ImportError as e:
        env["torch_error"] = str(e)
    env["nvcc"] = _first_line(["nvcc", "--version"], "release")
    # What the two compiles need: a C++ compiler, CMake, ninja and Python's C headers.
    env["tools"] = {tool: shutil.which(tool) for tool in ("c++", "g++", "cmake", "ninja")}
    env["python_h"] = (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
    query = "--query-gpu=name,driver_version,memory.total"
    env["nvidia_smi"] = _first_line(["nvidia-smi", query, "--format=csv,noheader"], "")
    return env


def _meminfo_gib() -> dict[str, float]:
    """MemTotal and MemAvailable: on a VM whose RAM grows as it is used they start low, and
    a plan's "auto" budget reads MemAvailable."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = round(int(value.split()[0]) / 2**20, 1)
    return out


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _first_line(argv: list[str], containing: str) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((ln.strip() for ln in out.splitlines() if containing in ln), None)


def main(site: Path, wheels: Path) -> None:
    with common.stage("environment") as numbers:
        numbers["mode"] = "cpu-dry-run" if common.dry_run() else "gpu"
        numbers["env"] = env = environment()
        common.log(json.dumps(env))
        site.mkdir(parents=True, exist_ok=True)
        numbers["wheels"] = install_wheels(site, wheels) if wheels.is_dir() else \
            "no wheels folder (run tools/gpu_check/prepare_wheels.sh and carry it)"
        if isinstance(numbers["wheels"], dict) and numbers["wheels"]["not_for_this_python"]:
            numbers["reason"] = (f"{len(numbers['wheels']['not_for_this_python'])} carried "
                                 f"wheels are for another Python: prepare_wheels.sh "
                                 f"{sys.version_info.major}.{sys.version_info.minor}")
        paths, tree = [str(site)], {}
        for rel in TREE:
            folder = common.REPO / rel
            if found := write_dist_info(site, folder):
                tree[found[0]] = found[1]
                paths.append(str(folder))
        numbers["tree"] = tree
        lines = [f"export PYTHONPATH={':'.join(paths)}${{PYTHONPATH:+:$PYTHONPATH}}"]
        if env.get("gpu_capability"):  # exllamav2's compile, for this GPU alone
            lines.append(f"export TORCH_CUDA_ARCH_LIST={env['gpu_capability']}")
        (site / "env.sh").write_text("\n".join(lines) + "\n")
        if env.get("cuda_available"):
            numbers["cuda_overheads"] = memory_probe.cuda_overheads()
            common.log(f"CUDA overheads: {numbers['cuda_overheads']}")
        if not common.dry_run() and not env.get("cuda_available"):
            numbers["status"] = common.FAIL
            numbers["reason"] = "torch sees no CUDA device: the GPU stages cannot run"


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
