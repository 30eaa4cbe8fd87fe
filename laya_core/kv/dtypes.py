"""The KV cache element types Laya knows, with their storage cost: the one list of them.

Each type stores ``block`` elements in ``bytes`` bytes (ggml's quantized blocks: q8_0 packs
32 values in 34 bytes). The manifest accepts these names, the memory plan prices them, and
a backend declares the subset it can store (``Backend.kv_cache_dtypes``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laya_core.models.files import ModelShape

KV_DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
}
KV_DTYPE_NAMES: tuple[str, ...] = tuple(KV_DTYPES)


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes, with quantized rows rounded up."""
    block, size = KV_DTYPES[dtype]
    k_row = math.ceil(shape.n_kv_heads * shape.head_dim_k / block) * size
    v_row = math.ceil(shape.n_kv_heads * shape.head_dim_v / block) * size
    return shape.n_layers * (k_row + v_row)
