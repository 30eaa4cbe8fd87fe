"""Refuses GGUF metadata no sound model has, before any backend sees the file.

The values the memory plan and the backends rely on (layer, head and vocabulary counts, the
embedding width, the context length) are checked here: present, whole numbers in range, and
in agreement with each other and with the tensor table the metadata describes. A problem
raises ``ModelFileError`` naming the metadata key.

A backend's library may refuse more: llama.cpp aborts the whole process (``GGML_ASSERT``)
on limits of its own, which its plugin checks (``Backend.check_model_metadata``) with the
helpers here, saying who needs the value (``need``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Counts are read as uint32 and multiplied in int32 or int64 arithmetic (llama.cpp does).
MAX_COUNT = 2**31 - 1
_NEED = "expected"  # how the core's own checks say what a value must be
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class ModelFileError(ValueError):
    """The file is not a model Laya can read the shape of."""


def count(meta: Mapping[str, Any], key: str, low: int, high: int = MAX_COUNT,
          need: str = _NEED) -> int:
    """The whole-number value of ``key``, which must be present, in [low, high]; a problem
    says ``{key} is {value}; {need} {what}``."""
    value = meta.get(key)
    if value is None:
        raise ModelFileError(f"{key} is missing")
    if type(value) is not int:
        raise ModelFileError(f"{key} is {value!r}; {need} a whole number")
    if not low <= value <= high:
        wanted = (f"{low} to {high}" if high < MAX_COUNT else
                  f"at least {low}" if value < low else f"at most {high}")
        raise ModelFileError(f"{key} is {value}; {need} {wanted}")
    return value


def optional_count(meta: Mapping[str, Any], key: str, low: int, high: int = MAX_COUNT,
                   need: str = _NEED) -> int | None:
    return None if meta.get(key) is None else count(meta, key, low, high, need)


def number(meta: Mapping[str, Any], key: str, positive: bool,
           need: str = _NEED) -> float | None:
    """A finite number (> 0 when ``positive``, else >= 0), or None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    bound = "> 0" if positive else ">= 0"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ModelFileError(f"{key} is {value!r}; {need} a finite number {bound}")
    return float(value)


def head_dim_k(meta: Mapping[str, Any], arch: str) -> int:
    """The K head size of metadata that :func:`check_metadata` passed: ``key_length``, else
    the embedding width over the most heads of a layer."""
    att = f"{arch}.attention"
    heads = meta[f"{att}.head_count"]
    n_heads = max(heads) if isinstance(heads, list) else heads
    return int(meta.get(f"{att}.key_length") or meta[f"{arch}.embedding_length"] // n_heads)


def _per_layer(meta: Mapping[str, Any], key: str, n_layers: int,
               default: list[int] | None) -> list[int]:
    """A count per layer, from one number or an array of ``n_layers``; ``default`` when the
    key is absent (None: it is required)."""
    value = meta.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, list):
        return [count(meta, key, 1)] * n_layers
    if len(value) != n_layers:  # llama.cpp: "key %s has wrong array length"
        raise ModelFileError(f"{key} has {len(value)} entries; block_count is {n_layers}")
    for i, v in enumerate(value):
        if type(v) is not int or not 0 <= v <= MAX_COUNT:
            raise ModelFileError(f"{key}[{i}] is {v!r}; {_NEED} 0 to {MAX_COUNT}")
    if max(value) < 1:
        raise ModelFileError(f"{key} is 0 in every layer; {_NEED} at least 1 head")
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
        raise ModelFileError(f"{key} is {n!r}: the file has no vocabulary; {_NEED} at least "
                             "1 token")
    return n


def check_metadata(meta: Mapping[str, Any], dims: Mapping[str, Sequence[int]]) -> str:
    """Refuse metadata no sound model has; returns the architecture.

    ``dims`` maps each tensor's name to its dimensions (ggml order, ``ne``).
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError("general.architecture is missing or not a string")
    said = meta.get(f"{arch}.block_count")
    if type(said) is int:  # first, so that an absurd count is named beside the real one
        _check_layers_match(f"{arch}.block_count", said, list(dims))
    n_layers = count(meta, f"{arch}.block_count", 1)
    att = f"{arch}.attention"
    heads = _per_layer(meta, f"{att}.head_count", n_layers, None)
    _check_heads(att, heads, _per_layer(meta, f"{att}.head_count_kv", n_layers, heads))
    n_embd = count(meta, f"{arch}.embedding_length", 1)
    head_k = optional_count(meta, f"{att}.key_length", 1)
    optional_count(meta, f"{att}.value_length", 1)
    if head_k is None and n_embd % max(heads):  # n_embd_head_k = n_embd / n_head
        raise ModelFileError(f"{arch}.embedding_length ({n_embd}) is not a multiple of "
                             f"{att}.head_count ({max(heads)}) and {att}.key_length is absent")
    count(meta, f"{arch}.context_length", 1)
    _check_tensor_shapes(arch, n_embd, vocab_size(meta, arch), dims)
    return arch

