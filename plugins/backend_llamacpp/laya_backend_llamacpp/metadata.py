"""GGUF metadata llama.cpp would abort on, refused before llama.cpp opens the file.

llama.cpp checks some of a model's metadata with ``GGML_ASSERT``, which aborts the whole
process instead of raising. The core's reader has already checked what every model needs
(``laya_core/models/checks.py``: counts present, whole and consistent); these are the limits
llama.cpp itself applies on top (cited from its ``src/llama-model.cpp``,
``src/llama-hparams.h`` and ``ggml-cpu/ops.cpp``). ``LlamaCppBackend.check_model_metadata``
runs them for ``laya check`` and ``laya plan``, and the load runs them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from laya_core.models.checks import ModelFileError, count, head_dim_k, number, optional_count

# load_hparams: GGML_ASSERT(hparams.n_layer_all > 0 && hparams.n_layer_all <= LLAMA_MAX_LAYERS)
LLAMA_MAX_LAYERS = 512
NEED = "llama.cpp needs"


def check_limits(meta: Mapping[str, Any]) -> None:
    """Raise ``ModelFileError`` naming the key of a value llama.cpp would abort on; ``meta``
    passed the core's ``check_metadata``."""
    arch = meta["general.architecture"]
    att = f"{arch}.attention"
    count(meta, f"{arch}.block_count", 1, LLAMA_MAX_LAYERS, NEED)
    for key in (f"{att}.layer_norm_rms_epsilon", f"{att}.layer_norm_epsilon"):
        number(meta, key, positive=False, need=NEED)  # ggml's norms: GGML_ASSERT(eps >= 0.0f)
    number(meta, f"{arch}.rope.freq_base", positive=True, need=NEED)
    number(meta, f"{arch}.rope.scaling.factor", positive=False, need=NEED)  # 0 means none
    key = f"{arch}.rope.dimension_count"
    n_rot = optional_count(meta, key, 2, head_dim_k(meta, arch), NEED)
    if n_rot is not None and n_rot % 2:  # ggml_compute_forward_rope: n_dims % 2 == 0
        raise ModelFileError(f"{key} is {n_rot}; {NEED} an even number")


def metadata_problem(meta: Mapping[str, Any],
                     tensor_dims: Mapping[str, Sequence[int]]) -> str | None:
    """``check_limits`` as the backend contract asks it: the problem, or None."""
    try:
        check_limits(meta)
    except ModelFileError as e:
        return str(e)
    return None
