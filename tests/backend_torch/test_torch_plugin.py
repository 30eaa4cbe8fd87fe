"""The torch plugin as the core sees it: registered, its options checked like every
backend's, its model paths checked, torch imported only for a manifest that uses it, and
its plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laya_core.config import manifest as mf
from laya_core.memory.ledger import Plan
from laya_core.memory.planner import make_plan
from laya_core.memory.report import format_plan
from laya_core.plugins import load_registry


def torch_model(**options: object) -> dict:
    return {"name": "m", "backend": "torch", "path": "embedded:smollm2-135m-instruct",
            "options": options}


@pytest.mark.parametrize(("options", "key", "words"), [
    ({"dtype": "float64"}, "models[0].options.dtype", '"auto", "float32"'),
    ({"device": "tpu"}, "models[0].options.device", '"cpu" or "cuda"'),
    ({"quantize": "int2"}, "models[0].options.quantize", '"none", "int8" or "int4"'),
    ({"n_threads": 0}, "models[0].options.n_threads", "from 1 to 1024"),
    ({"dtype": "float16"}, "models[0].options.dtype", '"float16" runs on cuda only'),
    ({"quantize": "int4", "device": "cuda"}, "models[0].options.quantize", "cpu only"),
    ({"compile": "yes"}, "models[0].options.compile", "true or false"),
    ({"threads": 2}, "models[0].options.threads", ""),
])
def test_bad_options_name_their_key(options: dict, key: str, words: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [torch_model(**options)]}), load_registry())
    assert info.value.key == key and words in str(info.value)


def test_good_options_pass() -> None:
    """Options the torch backend takes reach it as written, and the model path is found."""
    options = {"dtype": "bfloat16", "device": "cuda:1", "quantize": "int8", "n_threads": 3,
               "compile": True}
    (model,) = mf.resolve(mf.from_dict({"models": [torch_model(**options)]}),
                          load_registry()).models
    assert model.backend == "torch" and model.options == options
    assert model.path.endswith(".gguf") and Path(model.path).is_file(), model.path


@pytest.mark.parametrize(("make", "words"), [
    (lambda d: d, "without config.json"),
    (lambda d: (d / "config.json").write_text("{}") and d, "no .safetensors weights"),
    (lambda d: (d / "m.bin").write_bytes(b"PK\x03\x04") and d / "m.bin", "neither a GGUF"),
])
def test_model_paths_are_checked(tmp_path: Path, make, words: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [{"name": "m", "backend": "torch",
                                             "path": str(path)}]}), load_registry())
    assert words in str(info.value)


def test_torch_is_imported_only_for_a_manifest_that_uses_it() -> None:
    """The registry, a llama.cpp manifest's checks and its plan never import torch."""
    code = (
        "import sys\n"
        "from laya_core.config import manifest as mf\n"
        "from laya_core.plugins import load_registry\n"
        "from laya_core.memory.planner import make_plan\n"
        "r = load_registry()\n"
        "m = mf.resolve(mf.from_dict({'models': [{'name': 's', "
        "'path': 'embedded:smollm2-135m-instruct'}]}), r)\n"
        "make_plan(m, r)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_replicas_in_one_process_count_libtorch_once() -> None:
    """Two replicas are two engines in one process: one libtorch, two of the rest."""
    registry = load_registry()

    def plan(replicas: int) -> Plan:
        return make_plan(mf.resolve(mf.from_dict({"models": [{
            "name": "m", "backend": "torch", "path": "embedded:smollm2-135m-instruct",
            "max_seq_len": 256, "replicas": replicas}]}), registry), registry)

    one, two = plan(1), plan(2)
    (ledger,) = one.replicas
    lines = {o.name: o for o in ledger.profile.overheads}
    assert lines["torch runtime"].shared and not lines["torch threads"].shared
    assert two.shared_bytes_counted_once == lines["torch runtime"].bytes
    assert two.total_bytes - one.total_bytes == ledger.total_bytes - lines["torch runtime"].bytes
    assert "shared by this process's replicas" in format_plan(two)
    assert "shared, once" in format_plan(two) and "shared, once" not in format_plan(one)
