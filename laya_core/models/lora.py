"""LoRA adapters in PEFT's folder format and llama.cpp's GGUF file, read and checked from
their headers.

A PEFT adapter folder holds ``adapter_config.json`` (the rank ``r``, ``lora_alpha``, the
target modules) and ``adapter_model.safetensors``: for each adapted linear layer of the base
model, ``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` of shape [r, in] and
``lora_B.weight`` of shape [out, r]. The layer's output becomes ``W x + s B A x`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

:func:`read_adapter` checks a folder against the base model's shape before anything loads
(names, ranks, shapes, and that the file holds every byte its header promises) and says what
is wrong naming the field or the tensor; a backend prices what it holds of it in the memory
plan. :func:`read_gguf_adapter` does the same for the one-file GGUF adapters llama.cpp loads
(``blk.{i}.attn_q.weight.lora_a`` ..., written by llama.cpp's ``convert_lora_to_gguf.py``
from a PEFT folder). Nothing here imports torch: backends read the tensors themselves.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import attrs

from laya_core.models.files import ModelShape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The Llama family's linear layers a LoRA may adapt, and where each sits.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\."
                        r"(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
MAX_RANK = 1024
# The rank an adapter loaded while serving may have when the manifest does not say (vLLM's
# default max_lora_rank) and no adapter of its lora table is larger.
DEFAULT_MAX_RANK = 16


class AdapterError(ValueError):
    """The folder is not a LoRA adapter this base model can take."""


@attrs.frozen
class AdapterTensor:
    layer: int
    module: str  # one of MODULES
    part: str  # "A" or "B"
    shape: tuple[int, ...]
    dtype: str
    name: str  # as stored
    nbytes: int = 0  # as stored


@attrs.frozen
class Adapter:
    """What a PEFT adapter folder holds, checked: its scale and its tensors."""

    path: Path
    rank: int
    alpha: float
    scale: float  # multiplies B A x
    modules: frozenset[str]  # the adapted modules (of MODULES)
    tensors: tuple[AdapterTensor, ...]

    @property
    def num_elements(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """The matrices' bytes as the file stores them."""
        return sum(t.nbytes for t in self.tensors)


def rank_limit(max_lora_rank: int | None, ranks: list[int]) -> int:
    """The largest rank an adapter loaded while serving may have: ``max_lora_rank``, else
    the largest of the lora table's ``ranks``, else :data:`DEFAULT_MAX_RANK`."""
    if max_lora_rank is not None:
        return max_lora_rank
    return max(ranks or [DEFAULT_MAX_RANK])


def _config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder} has no {CONFIG_FILE} (a PEFT LoRA folder holds "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} is not a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], where: Path) -> tuple[int, float, float]:
    """(rank, alpha, scale); refuses what this reader does not apply."""
    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(f"{where}: {field} {why}")

    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise bad("peft_type", f"is {peft_type!r}; only LORA adapters are served")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise bad("r", f"must be an integer rank from 1 to {MAX_RANK}, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not \
            math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    for field in ("use_dora", "fan_in_fan_out"):
        if cfg.get(field):
            raise bad(field, "is set; only plain LoRA (no DoRA, weights as [out, in]) is "
                      "served")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"is {cfg['bias']!r}; only adapters without biases (\"none\") "
                  "are served")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", f"lists {cfg['modules_to_save']!r}; an adapter that "
                  "replaces whole modules is not served")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise bad(field, "is set; one rank and alpha for every module is served")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(alpha), float(scale)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header and where its data starts; refuses a truncated file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise AdapterError(f"{path} is truncated: {size} bytes, no header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise AdapterError(f"{path}: its header claims {n} bytes; the file has "
                                   f"{size}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise AdapterError(f"{path.parent} has no {WEIGHTS_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: not a safetensors file (its header is no object)")
    data = size - 8 - n
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"
            and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)]
    if ends and max(ends) > data:
        raise AdapterError(f"{path} is truncated: its tensors need {max(ends)} bytes of "
                           f"data, the file holds {data}")
    return header, data


def _tensors(header: dict[str, Any], path: Path) -> list[AdapterTensor]:
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        m = _TENSOR_RE.match(name)
        if m is None:
            raise AdapterError(f"{path}: tensor {name!r} is no LoRA matrix of a decoder "
                               "layer's linear module (layers.N.self_attn|mlp.NAME."
                               "lora_A|lora_B.weight)")
        layer, block, module, part = int(m[1]), m[2], m[3], m[4]
        expected = "self_attn" if module in ATTENTION_MODULES else "mlp"
        if module not in MODULES or block != expected:
            raise AdapterError(f"{path}: tensor {name!r} adapts {block}.{module}; the "
                               f"adaptable modules are {', '.join(MODULES)}")
        shape, dtype = t.get("shape"), t.get("dtype")
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(d, int) and d > 0 for d in shape)):
            raise AdapterError(f"{path}: tensor {name!r} has shape {shape!r}; LoRA matrices "
                               "are 2-dimensional")
        if dtype not in _DTYPE_BYTES:
            raise AdapterError(f"{path}: tensor {name!r} is {dtype}; adapters in "
                               f"{', '.join(_DTYPE_BYTES)} are read")
        start, end = t["data_offsets"]
        if end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise AdapterError(f"{path}: tensor {name!r}'s data is {end - start} bytes, its "
                               f"shape {shape} in {dtype} needs "
                               f"{math.prod(shape) * _DTYPE_BYTES[dtype]}")
        out.append(AdapterTensor(layer, module, part, tuple(shape), dtype, name, end - start))
    if not out:
        raise AdapterError(f"{path} holds no LoRA matrices")
    return out


def _io_sizes(shape: ModelShape) -> dict[str, tuple[int | None, int | None]]:
    """(in, out) features of each module, None where the shape does not say (the MLP's
    intermediate size; the backend checks it when it loads)."""
    h = shape.hidden_size
    q, kv = shape.n_heads * shape.head_dim_k, shape.n_kv_heads * shape.head_dim_k
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, shape.n_kv_heads *
                                                             shape.head_dim_v),
            "o_proj": (shape.n_heads * shape.head_dim_v, h), "gate_proj": (h, None),
            "up_proj": (h, None), "down_proj": (None, h)}


def read_adapter(folder: str | Path, base: ModelShape | None = None) -> Adapter:
    """The PEFT adapter in ``folder``, checked (against ``base`` where given); AdapterError
    says what is wrong, naming the field or tensor."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"no such folder: {folder} (a PEFT LoRA adapter is a folder with "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    rank, alpha, scale = _check_config(_config(folder), folder / CONFIG_FILE)
    path = folder / WEIGHTS_FILE
    header, _ = _header(path)
    tensors = _tensors(header, path)
    return _checked(folder, path, rank, alpha, scale, tensors, base)


def _checked(where_from: Path, path: Path, rank: int, alpha: float, scale: float,
             tensors: list[AdapterTensor], base: ModelShape | None) -> Adapter:
    """The adapter of ``tensors`` (A as [r, in], B as [out, r]) once each module has both
    matrices at ``rank`` and, with ``base``, the base model's sizes."""
    pairs: dict[tuple[int, str], dict[str, AdapterTensor]] = {}
    for t in tensors:
        pairs.setdefault((t.layer, t.module), {})[t.part] = t
    inter: set[int] = set()
    sizes = _io_sizes(base) if base is not None else {}
    for (layer, module), parts in sorted(pairs.items()):
        where = f"{path}: layers.{layer}.{module}"
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{''.join(parts)} without its partner")
        a, b = parts["A"].shape, parts["B"].shape
        if a[0] != rank or b[1] != rank:
            raise AdapterError(f"{where}: lora_A is {list(a)} and lora_B {list(b)}; with "
                               f"r = {rank} they must be [{rank}, in] and [out, {rank}]")
        if base is None:
            continue
        if layer >= base.n_layers:
            raise AdapterError(f"{where}: the base model has {base.n_layers} layers")
        want_in, want_out = sizes[module]
        for what, want, got in (("in", want_in, a[1]), ("out", want_out, b[0])):
            if want is not None and got != want:
                raise AdapterError(f"{where}: {what} features {got}, the base model's are "
                                   f"{want}: the adapter was trained on another model")
        if module in ("gate_proj", "up_proj"):
            inter.add(b[0])
        elif module == "down_proj":
            inter.add(a[1])
    if len(inter) > 1:
        raise AdapterError(f"{path}: the MLP modules disagree on the intermediate size "
                           f"({sorted(inter)})")
    return Adapter(where_from, rank, alpha, scale, frozenset(m for _, m in pairs),
                   tuple(tensors))


# llama.cpp's names of the modules (convert_lora_to_gguf.py writes them).
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                 "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                 "ffn_down": "down_proj"}
_GGUF_TENSOR_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0")


def read_gguf_adapter(path: str | Path, base: ModelShape | None = None) -> Adapter:
    """The llama.cpp LoRA adapter in the GGUF file ``path`` (as llama.cpp's
    ``convert_lora_to_gguf.py`` writes it), checked from its header (against ``base`` where
    given); AdapterError says what is wrong, naming the key or tensor.

    Its scale is llama.cpp's: ``adapter.lora.alpha / r``, or 1 where the file gives no alpha
    (or 0)."""
    from laya_core.models.checks import ModelFileError
    from laya_core.models.gguf_header import read_gguf_header

    path = Path(path)
    if path.is_dir():
        if (path / CONFIG_FILE).exists():
            raise AdapterError(f"{path} is a PEFT folder; the llamacpp backend takes a GGUF "
                               "LoRA file: convert it with llama.cpp's convert_lora_to_gguf.py "
                               "(--base: the base model's Hugging Face folder)")
        raise AdapterError(f"{path} is a folder; a llama.cpp LoRA adapter is one .gguf file")
    try:
        header = read_gguf_header(path, keep_items=64)
    except FileNotFoundError:
        raise AdapterError(f"no such file: {path}") from None
    except (ModelFileError, OSError, ValueError) as e:
        raise AdapterError(f"{path}: {e}") from None
    meta = header.metadata
    for key, want in (("general.type", "adapter"), ("adapter.type", "lora")):
        if meta.get(key) != want:
            raise AdapterError(f"{path}: {key} is {meta.get(key)!r}, not {want!r}: the file "
                               "is no LoRA adapter (a model file is loaded as a model)")
    if any(k.startswith("adapter.alora.") for k in meta):
        raise AdapterError(f"{path}: adapter.alora.invocation_tokens is set; activated LoRA "
                           "adapters are not served")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or \
            not math.isfinite(alpha):
        raise AdapterError(f"{path}: adapter.lora.alpha must be a number, got {alpha!r}")
    tensors = []
    for t in header.tensors:
        m = _GGUF_TENSOR_RE.match(t.name)
        if m is None or m[2] not in _GGUF_MODULES:
            raise AdapterError(f"{path}: tensor {t.name!r} is no LoRA matrix of a decoder "
                               f"layer's linear module (blk.N.{{{','.join(_GGUF_MODULES)}}}."
                               "weight.lora_a|lora_b)")
        if t.type.name not in _GGUF_TYPES:
            raise AdapterError(f"{path}: tensor {t.name!r} is {t.type.name}; adapters in "
                               f"{', '.join(_GGUF_TYPES)} are read")
        if len(t.dims) != 2:
            raise AdapterError(f"{path}: tensor {t.name!r} has {len(t.dims)} dimensions; "
                               "LoRA matrices have 2")
        # ggml order is numpy's reversed: A is [r, in] and B [out, r] as in PEFT.
        tensors.append(AdapterTensor(int(m[1]), _GGUF_MODULES[m[2]], m[3].upper(),
                                     (t.dims[1], t.dims[0]), t.type.name, t.name, t.nbytes))
    if not tensors:
        raise AdapterError(f"{path} holds no LoRA matrices")
    rank = next(t.shape[0] for t in tensors if t.part == "A") \
        if any(t.part == "A" for t in tensors) else tensors[0].shape[1]
    if not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{path}: rank {rank}; ranks from 1 to {MAX_RANK} are served")
    scale = float(alpha) / rank if alpha else 1.0
    return _checked(path, path, rank, float(alpha), scale, tensors, base)
