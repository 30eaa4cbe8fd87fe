"""The KV cache element types Laya knows, with their storage cost: the one list of them.

Each type stores ``block`` elements in ``bytes`` bytes (ggml's quantized blocks: q8_0 packs
32 values in 34 bytes). The manifest accepts these names, the memory plan prices them, and
a backend declares the subset it can store (``Backend.kv_cache_dtypes``).
"""

from __future__ import annotations

KV_DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
}
KV_DTYPE_NAMES: tuple[str, ...] = tuple(KV_DTYPES)
