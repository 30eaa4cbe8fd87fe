"""``laya check``, ``laya serve`` and ``laya plan`` on a manifest that selects an ExLlama
backend, run as a user runs them (the installed ``laya`` command). On a machine without an
NVIDIA GPU and CUDA, check and serve refuse in one plain line and exit 2, with no
traceback; a plan for a machine with GPUs (``--gpus``) is made here all the same, without
importing the library or torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from exl2_folders import manifest, write_exl2_folder
from laya_backend_exl2.host import cuda_problem

LAYA = str(Path(sys.executable).with_name("laya"))
NO_CUDA = cuda_problem("exl2", "exllamav2") is not None
pytestmark = pytest.mark.slow  # child processes


def laya(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LAYA, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exl2_cli")
    for backend, method in (("exl2", "exl2"), ("exl3", "exl3")):
        folder = write_exl2_folder(root / backend, method=method)
        (root / f"{backend}.toml").write_text(
            manifest(folder, backend, max_step_tokens=256).replace("{port}", "0"))
    return root


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA and the library: the refusal "
                    "is for machines without (test_exl2_gpu.py serves there)")
@pytest.mark.parametrize("command", ["check", "serve"])
@pytest.mark.parametrize(("backend", "library"), [("exl2", "exllamav2"), ("exl3", "exllamav3")])
def test_without_cuda_check_and_serve_refuse_in_one_line(workdir: Path, command: str,
                                                         backend: str, library: str) -> None:
    out = laya(command, f"{backend}.toml", cwd=workdir)
    assert out.returncode == 2, out
    said = [line for line in out.stderr.splitlines() if "NVIDIA" in line]
    assert len(said) == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    assert f"the {backend} backend needs an NVIDIA GPU with CUDA" in said[0]
    assert said[0].startswith("laya: "), said


def test_a_plan_for_a_machine_with_a_gpu_is_made_without_the_library(workdir: Path) -> None:
    out = laya("plan", "exl2.toml", "--gpus", "24GiB", "--json", cwd=workdir)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    (replica,) = plan["replicas"]
    assert set(replica["gpu_bytes"]) == {"cuda:0"} and plan["gpus"]["cuda:0"]["total_bytes"]
    text = laya("plan", "exl2.toml", "--gpus", "24GiB", cwd=workdir).stdout
    assert "CUDA context cuda:0" in text and "exllamav2 runtime" in text


def test_checking_a_manifest_imports_neither_library_nor_torch(workdir: Path) -> None:
    code = (
        "import sys\n"
        "from laya_core.config import manifest as mf\n"
        "from laya_core.memory import planner\n"
        "from laya_core.plugins import load_registry\n"
        "r = load_registry()\n"
        f"m = mf.build(mf.read_toml({str(workdir / 'exl2.toml')!r}), r)\n"
        "planner.make_plan(m, r, machine=planner.Machine(gpus=(2**34,)))\n"
        "print(sorted({'torch', 'exllamav2', 'exllamav3'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=workdir)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
