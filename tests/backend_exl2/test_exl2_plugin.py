"""The exl2 and exl3 backends as the core sees them: registered without importing their
libraries or torch, their options, KV types and model folders checked with messages that
name the key, and chosen for their own formats where a manifest names no backend."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from exl2_folders import write_exl2_folder
from safetensors.numpy import save_file

from laya_core.config import manifest as mf
from laya_core.plugins import load_registry


def resolve(folder: Path, **model: Any) -> Any:
    entry = {"name": "m", "backend": "exl2", "path": str(folder), **model}
    return mf.resolve(mf.from_dict({"models": [entry]}), load_registry()).models[0]


@pytest.fixture(scope="module")
def exl2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_exl2_folder(tmp_path_factory.mktemp("exl2") / "m")


def test_both_are_registered_without_importing_a_library() -> None:
    backends = load_registry().backends
    assert backends["exl2"].obj.kind == backends["exl3"].obj.kind == "engine"
    assert backends["exl2"].obj.block_size == 256
    # (test_exl2_cli.py checks in a process of its own that torch is not imported either.)
    assert not {"exllamav2", "exllamav3"} & set(sys.modules)


@pytest.mark.parametrize(("options", "key", "words"), [
    ({"device": "cuda"}, "models[0].options.device", '"cuda:0" to "cuda:15"'),
    ({"device": "cpu"}, "models[0].options.device", "not 'cpu'"),
    ({"device": "cuda:16"}, "models[0].options.device", "a GPU's name"),
    ({"gpu_split": []}, "models[0].options.gpu_split", "1 to 16 numbers above 0"),
    ({"gpu_split": [20, 0]}, "models[0].options.gpu_split", "not [20, 0]"),
    ({"gpu_split": "even"}, "models[0].options.gpu_split", '"auto" or a list of GiB'),
    ({"gpu_split": [True]}, "models[0].options.gpu_split", "numbers above 0"),
    ({"device": "cuda:1", "gpu_split": [8, 8]}, "models[0].options.gpu_split",
     "either device"),
    ({"cache_mode": "Q4"}, "models[0].options.cache_mode", "device, gpu_split"),
])
def test_bad_options_name_their_key(exl2: Path, options: dict, key: str, words: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        resolve(exl2, options=options)
    assert info.value.key == key and words in str(info.value), info.value


def test_good_options_and_cache_types_pass(exl2: Path) -> None:
    for options in ({"device": "cuda:3"}, {"gpu_split": [20, 23.5]}, {"gpu_split": "auto"}):
        for dtype in ("f16", "q8", "q6", "q4"):
            model = resolve(exl2, options=options, kv_cache_dtype=dtype)
            assert model.options == options and model.kv_cache_dtype == dtype


def test_a_cache_type_it_lacks_is_refused_with_its_types(exl2: Path) -> None:
    with pytest.raises(mf.ManifestError) as info:
        resolve(exl2, kv_cache_dtype="q8_0")
    assert info.value.key == "models[0].kv_cache_dtype"
    assert "its KV types are f16, q8, q6, q4" in str(info.value)


def _unquantized(d: Path) -> Path:
    folder = write_exl2_folder(d / "plain", method=None)
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float16)},
              str(folder / "model.safetensors"))  # dense: no *.q_weight
    return folder


def _without_tokenizer(d: Path) -> Path:
    folder = write_exl2_folder(d / "m")
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize(("make", "backend", "words"), [
    (lambda d: d / "missing", "exl2", "no such file"),
    (lambda d: (d / "m.bin").write_bytes(b"PK\x03\x04") and d / "m.bin", "exl2",
     "is not a folder; the exl2 backend loads an EXL2 or GPTQ model folder"),
    (lambda d: write_exl2_folder(d / "m", method="exl3"), "exl2",
     "holds EXL3 weights, not EXL2 or GPTQ: serve it with the exl3 backend"),
    (lambda d: write_exl2_folder(d / "m"), "exl3",
     "holds EXL2 weights, not EXL3: serve it with the exl2 backend"),
    (_unquantized, "exl2",
     "holds unquantized weights, not EXL2 or GPTQ: serve it with the torch backend"),
    (_without_tokenizer, "exl2", "has no tokenizer.json"),
])
def test_model_folders_are_checked(tmp_path: Path, make: Callable[[Path], Path],
                                   backend: str, words: str) -> None:
    path = make(tmp_path)
    with pytest.raises(mf.ManifestError) as info:
        resolve(path, backend=backend)
    assert info.value.key == "models[0].path" and words in str(info.value), info.value


def test_gptq_and_old_exl2_folders_are_exl2s(tmp_path: Path) -> None:
    assert resolve(write_exl2_folder(tmp_path / "gptq", method="gptq")).backend == "exl2"
    # Converted without -cf: config.json says nothing, its *.q_weight tensors tell.
    old = write_exl2_folder(tmp_path / "old", method=None)
    assert "quantization_config" not in json.loads((old / "config.json").read_text())
    assert resolve(old).backend == "exl2"


def test_a_folder_without_backend_gets_its_formats_backend(tmp_path: Path) -> None:
    """An EXL2 or EXL3 folder (one converted without quantization_config too) gets its
    exllama, which the torch backend refuses; a GPTQ folder gets torch, which serves it on a
    CPU as well (backend = "exl2" serves it through exllamav2)."""
    folders = {"a": write_exl2_folder(tmp_path / "a"),
               "b": write_exl2_folder(tmp_path / "b", method="exl3"),
               "c": write_exl2_folder(tmp_path / "c", method=None),
               "d": write_exl2_folder(tmp_path / "d", method="gptq")}
    registry = load_registry()
    models = mf.resolve(mf.from_dict({"models": [{"name": n, "path": str(p)} for n, p
                                                 in folders.items()]}), registry).models
    assert [m.backend for m in models] == ["exl2", "exl3", "exl2", "torch"]
