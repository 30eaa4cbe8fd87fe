"""Refuses GGUF metadata that llama.cpp would abort on, before any backend sees the file.

llama.cpp checks much of a model's metadata with ``GGML_ASSERT``, which aborts the whole
process instead of raising, and divides by head counts unchecked. So the values a plan or a
backend relies on are checked here, each against the limit llama.cpp itself applies (cited
below from its ``src/llama-model.cpp``, ``src/llama-hparams.h`` and ``ggml-cpu/ops.cpp``), and
against the tensor table the metadata describes. A problem raises ``ModelFileError`` naming
the metadata key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# load_hparams: GGML_ASSERT(hparams.n_layer_all > 0 && hparams.n_layer_all <= LLAMA_MAX_LAYERS)
LLAMA_MAX_LAYERS = 512
# Counts llama.cpp reads as uint32 and multiplies in int32 or int64 arithmetic.
_MAX_COUNT = 2**31 - 1
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class ModelFileError(ValueError):
    """The file is not a model Laya can read the shape of."""


def _count(meta: Mapping[str, Any], key: str, low: int, high: int = _MAX_COUNT) -> int:
    """The whole-number value of ``key``, which must be present, in [low, high]."""
    value = meta.get(key)
    if value is None:
        raise ModelFileError(f"{key} is missing")
    if type(value) is not int:
        raise ModelFileError(f"{key} is {value!r}; llama.cpp needs a whole number")
    if not low <= value <= high:
        wanted = (f"{low} to {high}" if high < _MAX_COUNT else
                  f"at least {low}" if value < low else f"at most {high}")
        raise ModelFileError(f"{key} is {value}; llama.cpp needs {wanted}")
    return value


def _optional_count(meta: Mapping[str, Any], key: str, low: int,
                    high: int = _MAX_COUNT) -> int | None:
    return None if meta.get(key) is None else _count(meta, key, low, high)


def _number(meta: Mapping[str, Any], key: str, positive: bool) -> float | None:
    """A finite number (> 0 when ``positive``, else >= 0), or None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    bound = "> 0" if positive else ">= 0"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ModelFileError(f"{key} is {value!r}; llama.cpp needs a finite number {bound}")
    return float(value)


def _per_layer(meta: Mapping[str, Any], key: str, n_layers: int,
               default: list[int] | None) -> list[int]:
    """A count per layer, from one number or an array of ``n_layers``; ``default`` when the
    key is absent (None: it is required)."""
    value = meta.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, list):
        return [_count(meta, key, 1)] * n_layers
    if len(value) != n_layers:  # llama.cpp: "key %s has wrong array length"
        raise ModelFileError(f"{key} has {len(value)} entries; block_count is {n_layers}")
    for i, v in enumerate(value):
        if type(v) is not int or not 0 <= v <= _MAX_COUNT:
            raise ModelFileError(f"{key}[{i}] is {v!r}; llama.cpp needs 0 to {_MAX_COUNT}")
    if max(value) < 1:
        raise ModelFileError(f"{key} is 0 in every layer; llama.cpp needs at least 1 head")
    return value


def _check_layers_match(key: str, n_layers: int, tensor_names: Sequence[str]) -> None:
    """block_count agrees with the blk.N tensors (a layer without tensors fails the load)."""
    layers = {int(m.group(1)) for name in tensor_names if (m := _LAYER_RE.match(name))}
    if layers and max(layers) + 1 != n_layers:
        raise ModelFileError(f"{key} is {n_layers} but the tensor table has {max(layers) + 1} "
                             f"layers (blk.0 to blk.{max(layers)})")


def _check_heads(prefix: str, heads: list[int], kv_heads: list[int]) -> None:
    for il, (h, kv) in enumerate(zip(heads, kv_heads, strict=True)):
        if h and (kv < 1 or h % kv):  # n_gqa() = n_head / n_head_kv
            raise ModelFileError(
                f"{prefix}.head_count_kv is {kv} (layer {il}); it must be at least 1 and divide "
                f"{prefix}.head_count ({h})")


def _check_tensor_shapes(arch: str, n_embd: int, vocab: int,
                         dims: Mapping[str, Sequence[int]]) -> None:
    embd = dims.get("token_embd.weight")  # ne: [n_embd, n_vocab]
    if embd and len(embd) == 2 and embd[0] != n_embd:
        raise ModelFileError(f"{arch}.embedding_length is {n_embd} but token_embd.weight is "
                             f"{embd[0]} wide")
    if embd and len(embd) == 2 and embd[1] != vocab:
        raise ModelFileError(f"the vocabulary has {vocab} tokens but token_embd.weight has "
                             f"{embd[1]} rows")


def vocab_size(meta: Mapping[str, Any], arch: str) -> int:
    """``{arch}.vocab_size``, else the length of ``tokenizer.ggml.tokens``; at least 1."""
    key = f"{arch}.vocab_size" if f"{arch}.vocab_size" in meta else "tokenizer.ggml.tokens"
    value = meta.get(key)
    n = len(value) if isinstance(value, list) else value
    if type(n) is not int or n < 1:
        raise ModelFileError(f"{key} is {n!r}: the file has no vocabulary; llama.cpp needs at "
                             "least 1 token")
    return n


def check_metadata(meta: Mapping[str, Any], dims: Mapping[str, Sequence[int]]) -> str:
    """Refuse metadata llama.cpp would abort on; returns the architecture.

    ``dims`` maps each tensor's name to its dimensions (ggml order, ``ne``).
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError("general.architecture is missing or not a string")
    said = meta.get(f"{arch}.block_count")
    if type(said) is int:  # first, so that an absurd count is named beside the real one
        _check_layers_match(f"{arch}.block_count", said, list(dims))
    n_layers = _count(meta, f"{arch}.block_count", 1, LLAMA_MAX_LAYERS)
    att = f"{arch}.attention"
    heads = _per_layer(meta, f"{att}.head_count", n_layers, None)
    _check_heads(att, heads, _per_layer(meta, f"{att}.head_count_kv", n_layers, heads))
    n_embd = _count(meta, f"{arch}.embedding_length", 1)
    head_k = _optional_count(meta, f"{att}.key_length", 1)
    _optional_count(meta, f"{att}.value_length", 1)
    if head_k is None and n_embd % max(heads):  # n_embd_head_k = n_embd / n_head
        raise ModelFileError(f"{arch}.embedding_length ({n_embd}) is not a multiple of "
                             f"{att}.head_count ({max(heads)}) and {att}.key_length is absent")
    _check_rope(meta, arch, head_k or n_embd // max(heads))
    for key in (f"{att}.layer_norm_rms_epsilon", f"{att}.layer_norm_epsilon"):
        _number(meta, key, positive=False)  # ggml's norms: GGML_ASSERT(eps >= 0.0f)
    _count(meta, f"{arch}.context_length", 1)
    _check_tensor_shapes(arch, n_embd, vocab_size(meta, arch), dims)
    return arch


def _check_rope(meta: Mapping[str, Any], arch: str, head_dim_k: int) -> None:
    _number(meta, f"{arch}.rope.freq_base", positive=True)
    _number(meta, f"{arch}.rope.scaling.factor", positive=False)  # 0 means none
    key = f"{arch}.rope.dimension_count"
    n_rot = _optional_count(meta, key, 2, head_dim_k)
    if n_rot is not None and n_rot % 2:  # ggml_compute_forward_rope: n_dims % 2 == 0
        raise ModelFileError(f"{key} is {n_rot}; llama.cpp needs an even number")
