"""What the ExLlama backends ask of the machine (``check_devices``, which laya check, plan
and serve call for the machine they run on): an NVIDIA driver, torch with CUDA, the library
installed, and the GPUs the options name; each missing one said in one line under its key."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from exl2_folders import write_exl2_folder
from laya_backend_exl2 import host
from laya_backend_exl2.backend import Exl2Backend

from laya_core.backend import ModelConfig
from laya_core.memory import devices

GIB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_exl2_folder(tmp_path_factory.mktemp("host") / "m")


def config(path: Path, **options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend="exl2", path=str(path), options=options)


def test_no_driver_is_said_without_importing_anything(tmp_path: Path) -> None:
    before = set(sys.modules)
    said = host.cuda_problem("exl2", "exllamav2", (str(tmp_path / "nvidia0"),))
    assert said is not None and said.startswith(
        "the exl2 backend needs an NVIDIA GPU with CUDA, and this machine has none")
    assert set(sys.modules) == before


def test_a_driver_without_cuda_torch_or_the_library(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    driver = tmp_path / "nvidia0"
    driver.touch()
    installed = {"torch"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed else
                        (None if name in ("torch", "exllamav2") else real(name, *a)))
    fake = types.SimpleNamespace(__version__="2.9.0+cpu", cuda=types.SimpleNamespace(
        is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)

    def said() -> str | None:
        return host.cuda_problem("exl2", "exllamav2", (str(driver),))

    assert "torch 2.9.0+cpu finds no CUDA device" in (said() or "")
    fake.cuda.is_available = lambda: True
    assert "needs the exllamav2 package, which is not installed" in (said() or "")
    installed.add("exllamav2")
    assert said() is None
    installed.clear()
    assert "through torch, which is not installed" in (said() or "")


def test_without_cuda_the_refusal_is_the_backends_with_a_hint_for_gptq(tmp_path: Path) -> None:
    gptq = write_exl2_folder(tmp_path / "gptq", method="gptq")
    problems = Exl2Backend.check_devices(config(gptq), devices.NO_GPUS)
    assert list(problems) == ["backend"]
    assert "needs an NVIDIA GPU with CUDA" in problems["backend"]
    assert problems["backend"].endswith('a GPTQ folder also runs on a CPU with backend = "torch"')


def test_gpus_the_machine_lacks_are_named_under_their_option(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Planned for another machine (laya plan --gpus): this machine's CUDA is not asked
    # about (it has none), only the GPUs that machine has.
    one = devices.given((24 * GIB,))
    assert Exl2Backend.check_devices(config(folder), one) == {}
    assert Exl2Backend.check_devices(config(folder, device="cuda:1"), one) == {
        "options.device": "the machine planned for (--gpus) has no cuda:1 (its GPUs: cuda:0)"}
    assert Exl2Backend.check_devices(config(folder, gpu_split=[8, 8]), one) == {
        "options.gpu_split": "the machine planned for (--gpus) has no cuda:1 (its GPUs: "
                             "cuda:0)"}
    assert Exl2Backend.check_devices(config(folder, gpu_split="auto"), one) == {}
    # On this machine, with CUDA there (as if), the same GPUs are this machine's.
    monkeypatch.setattr("laya_backend_exl2.backend.cuda_problem", lambda *a: None)
    here = devices.Gpus(one.budgets)
    assert Exl2Backend.check_devices(config(folder, device="cuda:1"), here) == {
        "options.device": "this machine has no cuda:1 (its GPUs: cuda:0)"}
