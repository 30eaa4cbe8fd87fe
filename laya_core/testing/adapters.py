"""LoRA adapters of random matrices for any model shape, for the conformance suite's checks
of a backend that says ``supports_lora``: on the attention's q and v projections, whose
sizes the model's shape gives, written in the backend's ``lora_format``: as PEFT writes a
folder (``adapter_config.json`` + ``adapter_model.safetensors``; no numpy or torch: a JSON
header and little-endian float32 data), or as llama.cpp's one GGUF file (through ``gguf``,
the core's dependency).
"""

from __future__ import annotations

import array
import json
import math
import random
import struct
import sys
from pathlib import Path

from laya_core.models.files import ModelShape


def random_adapter(folder: Path, shape: ModelShape, seed: int, rank: int = 4,
                   alpha: float = 8.0, zero: bool = False, fmt: str = "peft") -> Path:
    """A rank-``rank`` adapter of q_proj and v_proj in every layer, its matrices drawn from
    ``seed``: A with unit-variance rows over the hidden size, B strong enough that the
    model's answers change (scale ``alpha / rank``); with ``zero``, B = 0 (as PEFT starts an
    adapter): it changes nothing. ``fmt``: "peft" (a folder at ``folder``) or "gguf" (the
    file ``folder`` + ``.gguf``); returns the path written."""
    draw = random.Random(seed)
    outs = {"q_proj": shape.n_heads * shape.head_dim_k,
            "v_proj": shape.n_kv_heads * shape.head_dim_v}
    tensors: dict[str, tuple[list[int], array.array[float]]] = {}
    for layer in range(shape.n_layers):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = array.array("f", (draw.gauss(0, 1 / math.sqrt(shape.hidden_size))
                                  for _ in range(rank * shape.hidden_size)))
            b = array.array("f", (0.0 if zero else draw.gauss(0, 0.5)
                                  for _ in range(out * rank)))
            tensors[f"{name}.lora_A.weight"] = ([rank, shape.hidden_size], a)
            tensors[f"{name}.lora_B.weight"] = ([out, rank], b)
    if fmt == "gguf":
        return _save_gguf(tensors, folder.with_name(folder.name + ".gguf"), shape, alpha)
    if fmt != "peft":
        raise ValueError(f"no adapter format {fmt!r}: 'peft' or 'gguf'")
    folder.mkdir(parents=True)
    _save(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": list(outs)}))
    return folder


def _save(tensors: dict[str, tuple[list[int], array.array[float]]], path: Path) -> None:
    header: dict[str, object] = {}
    offset = 0
    for name, (dims, data) in tensors.items():
        size = len(data) * 4
        header[name] = {"dtype": "F32", "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, data in tensors.values():
            if sys.byteorder != "little":
                data = array.array("f", data)
                data.byteswap()
            f.write(data.tobytes())


# PEFT's module names as llama.cpp's.
_GGUF_NAMES = {"q_proj": "attn_q", "v_proj": "attn_v"}


def _save_gguf(tensors: dict[str, tuple[list[int], array.array[float]]], path: Path,
               shape: ModelShape, alpha: float) -> Path:
    """The matrices as llama.cpp's LoRA GGUF (``blk.N.attn_q.weight.lora_a`` ...)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, shape.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, (dims, data) in tensors.items():
        parts = name.split(".")  # base_model.model.model.layers.L.self_attn.M.lora_X.weight
        layer, module, part = parts[4], parts[6], parts[7][-1].lower()
        writer.add_tensor(f"blk.{layer}.{_GGUF_NAMES[module]}.weight.lora_{part}",
                          np.frombuffer(data.tobytes(), dtype="<f4").reshape(dims))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
