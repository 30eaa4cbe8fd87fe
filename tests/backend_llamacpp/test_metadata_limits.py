"""The limits llama.cpp aborts the process on (``GGML_ASSERT``) are the llama.cpp plugin's:
its ``check_model_metadata`` refuses them for ``laya check``, ``laya plan`` and its load,
while the core's reader (and so a backend without those limits) reads such a file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import hostile_gguf as hg
import pytest
from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_backend_llamacpp.metadata import LLAMA_MAX_LAYERS, check_limits

from laya_core.config import manifest as mf
from laya_core.models.checks import check_metadata
from laya_core.models.files import ModelFileError, read_shape
from laya_core.plugins import load_registry


@pytest.mark.parametrize(("key", "value", "kind", "said"), [
    ("llama.attention.layer_norm_rms_epsilon", math.nan, "f32",
     "llama.attention.layer_norm_rms_epsilon is nan; llama.cpp needs a finite number >= 0"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, "f32", "needs a finite number >= 0"),
    ("llama.attention.layer_norm_rms_epsilon", math.inf, "f32", "is inf; llama.cpp needs a finite"),
    ("llama.rope.freq_base", 0.0, "f32", "llama.rope.freq_base is 0.0; llama.cpp needs a finite number > 0"),
    ("llama.rope.freq_base", math.nan, "f32", "llama.rope.freq_base is nan"),
    ("llama.rope.dimension_count", 63, "u32", "dimension_count is 63; llama.cpp needs an even number"),
    ("llama.rope.dimension_count", 999, "u32", "dimension_count is 999; llama.cpp needs 2 to 64"),
])
def test_what_llama_cpp_would_abort_on_is_its_plugins_to_refuse(
        tmp_path: Path, key: str, value: Any, kind: str, said: str) -> None:
    path = hg.with_metadata(hg.embedded(), tmp_path / "bad.gguf", key, value, kind)
    assert read_shape(path).n_layers == 30  # the core's reader: no such limit of its own
    with pytest.raises(ModelFileError) as info:
        LlamaCppBackend.model_shape(str(path))
    assert said in str(info.value) and str(path) in str(info.value)
    data = {"models": [{"name": "m", "path": str(path), "backend": "llamacpp"}]}
    with pytest.raises(mf.ManifestError) as refused:
        mf.resolve(mf.from_dict(data), load_registry())
    assert refused.value.key == "models[0].path" and said in refused.value.message


@pytest.mark.parametrize(("changes", "said"), [
    ({"llama.block_count": LLAMA_MAX_LAYERS + 1}, "llama.block_count is 513; llama.cpp needs 1 to 512"),
    ({"llama.attention.layer_norm_epsilon": True}, "layer_norm_epsilon is True"),
])
def test_llama_cpp_limits(changes: dict[str, Any], said: str) -> None:
    meta = hg.small_llama(**changes)
    check_metadata(meta, {})  # sound for the core
    with pytest.raises(ModelFileError) as info:
        check_limits(meta)
    assert said in str(info.value)
