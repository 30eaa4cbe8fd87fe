"""KV cache element types and their storage cost, as backends declare them.

A backend declares the types it can store, each with its price: ``name -> (elements per
block, bytes per block)`` (``Backend.kv_cache_dtypes``). A plain type stores one element
per block (f16: 1 element in 2 bytes); a quantized one packs a block of elements with its
scale (ggml's q8_0: 32 values in 34 bytes, declared by the llama.cpp plugin). The manifest
checks ``kv_cache_dtype`` against the chosen backend's names, and the memory plan prices it
with the backend's table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laya_core.models.files import ModelShape

# name -> (elements per block, bytes per block)
KVDtypes = Mapping[str, tuple[int, int]]

# The plain floating-point types, as any backend that stores them declares them.
FLOAT_KV_DTYPES: dict[str, tuple[int, int]] = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2)}


def kv_dtype_problems(dtypes: KVDtypes) -> list[str]:
    """What is wrong with a backend's table of KV types (empty when nothing is)."""
    problems = [] if dtypes else ["it declares no KV element type"]
    for name, price in dtypes.items():
        if not (isinstance(name, str) and name and isinstance(price, tuple) and len(price) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                        for n in price)):
            problems.append(f"KV type {name!r}: {price!r} is not (elements per block, bytes "
                            "per block), two whole numbers above 0")
    return problems


def bytes_per_element(dtype: str, dtypes: KVDtypes) -> float:
    """What one stored element of ``dtype`` costs, in bytes (its block's share)."""
    elements, size = dtypes[dtype]
    return size / elements


def kv_bytes_per_token(shape: ModelShape, dtype: str,
                       dtypes: KVDtypes = FLOAT_KV_DTYPES) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes, with quantized rows rounded up
    to whole blocks; ``dtype`` priced by ``dtypes`` (the backend's table)."""
    block, size = dtypes[dtype]
    k_row = math.ceil(shape.n_kv_heads * shape.head_dim_k / block) * size
    v_row = math.ceil(shape.n_kv_heads * shape.head_dim_v / block) * size
    return shape.n_layers * (k_row + v_row)
