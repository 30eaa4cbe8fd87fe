"""The two compiles, run by tools/gpu_check.sh in the background while the GPU stages run.

    python tools/gpu_check/builds.py router TARGET   # stage "router_build"
    python tools/gpu_check/builds.py exl2            # stage "exl2_build"

router: plugins/router_nanobind (C++, nanobind, scikit-build-core) built with the machine's
CMake, ninja and nanobind, no build isolation, installed into TARGET; the script puts
TARGET on PYTHONPATH at a fixed point, so every stage after it serves with the C++ router
(Laya's default once ``laya-router`` is installed) and none sees a half-installed one.

exl2: exllamav2's extension (``exllamav2_ext``, 28 CUDA and 19 C++ files) compiled by its
own JIT path, ``import exllamav2`` (torch.utils.cpp_extension.load with ninja): PyPI has
only its py3-none-any wheel, whose prebuilt CUDA wheels stop at torch 2.9. Built for this
GPU's architecture alone (TORCH_CUDA_ARCH_LIST, set by the script) to save minutes, with
CUDA_HOME taken from the ``nvcc`` on PATH (through links) where unset, and the headers of
pip's NVIDIA packages (cuBLAS's, for one) on CPATH where CUDA_HOME lacks them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common


def build_router(target: Path) -> None:
    with common.stage("router_build") as numbers:
        env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("ROUTER_JOBS", "4"))
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                        "--no-build-isolation", "--no-compile", "--target", str(target),
                        str(common.REPO / "plugins" / "router_nanobind")], env=env, check=True)
        numbers["build_s"] = round(time.monotonic() - start, 1)
        numbers["installed"] = sorted(p.name for p in target.iterdir())


def nvcc_major() -> int | None:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+)\.", out)
    return int(found.group(1)) if found else None


def cuda_home() -> Path | None:
    """CUDA_HOME, else the toolkit of the ``nvcc`` on PATH, else /usr/local/cuda: the first
    with CUDA's headers (torch guesses /usr/local for a wrapper in /usr/local/bin)."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent] if nvcc else []
    candidates.append(Path("/usr/local/cuda"))
    return next((c for c in candidates if (c / "include" / "cuda_runtime.h").is_file()), None)


def nvidia_headers(home: Path | None) -> list[str]:
    """Include folders of pip's NVIDIA packages holding cuBLAS's header, where the toolkit
    in ``home`` has none (a toolkit of the compiler alone)."""
    if home is not None and (home / "include" / "cublas_v2.h").is_file():
        return []
    import site

    roots = [Path(p) / "nvidia" for p in site.getsitepackages() + sys.path if p]
    return sorted({str(h.parent) for root in roots if root.is_dir()
                   for h in root.glob("*/include/cublas_v2.h")})


def ninja_on_path() -> None:
    """torch's JIT build runs ``ninja``; the pip package's binary may not be on PATH."""
    try:
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except (ImportError, AttributeError):
        pass


def build_exl2() -> None:
    with common.stage("exl2_build") as numbers:
        import torch

        if not torch.cuda.is_available():
            numbers.update(status=common.SKIPPED, reason="no CUDA device: exllamav2 is CUDA-only")
            return
        spec = importlib.util.find_spec("exllamav2")
        if spec is None or spec.origin is None:
            raise common.StageFailed("exllamav2 is not installed: carry its wheel "
                                     "(tools/gpu_check/prepare_wheels.sh)")
        numbers["nvcc_major"] = nvcc_major()
        home = cuda_home()
        if home is not None:
            os.environ["CUDA_HOME"] = numbers["cuda_home"] = str(home)
        if headers := nvidia_headers(home):
            os.environ["CPATH"] = os.pathsep.join([*headers, os.environ.get("CPATH", "")])
            numbers["cpath"] = headers
        numbers["arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
        numbers["max_jobs"] = os.environ.get("MAX_JOBS")
        ninja_on_path()
        start = time.monotonic()
        import exllamav2  # noqa: F401 - compiles exllamav2_ext the first time
        from exllamav2 import attn

        numbers["build_s"] = round(time.monotonic() - start, 1)
        numbers["flash_attn_paged"] = attn.has_flash_attn_with_paged
        common.log(f"exllamav2_ext built in {numbers['build_s']} s")


if __name__ == "__main__":
    if sys.argv[1] == "router":
        build_router(Path(sys.argv[2]))
    else:
        build_exl2()
