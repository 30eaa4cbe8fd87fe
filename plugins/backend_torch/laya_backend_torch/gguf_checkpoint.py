"""GGUF files as the torch backend reads them: the header scanned for its metadata and tensor
table, the config in Hugging Face's terms, and tensors under Hugging Face names and shapes.

llama.cpp's converter renames every tensor and permutes Q and K rows for its interleaved
rotary (Q by ``n_head``, K by ``n_head_kv``), which ``GGUFFile.tensors()`` undoes, and stores
Llama 3's rotary as per-frequency divisors (``rope_freqs.weight``), which are mapped back to a
llama3 ``rope_scaling``. The header is scanned here rather than by ``gguf.GGUFReader``, which
parses every vocabulary string into numpy (about 2 s for 49k tokens) before it gives a single
value; the memory planner calls ``read_config`` for each model, and the tokenizer reads the
vocabulary through ``read_metadata``. ``checkpoint.open_checkpoint`` is the entry point; this
module is imported when it meets a GGUF file.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from gguf.constants import GGMLQuantizationType as Q

from laya_backend_torch.checkpoint import (
    ARCHITECTURES,
    CheckpointError,
    LlamaConfig,
    check_tensor_names,
    llama3_rope_factors,
)

__all__ = ["GGUFFile"]

# Written by the converter's LlamaModel, which permutes Q and K; Qwen2 keeps the rotate-half
# (NeoX) rotary of Hugging Face, so its rows are stored as they are.
_PERMUTED = {"llama", "mistral"}
_GGUF_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16,
               Q.Q8_0: None, Q.Q4_0: None, Q.Q4_1: None}  # None: dequantized to float32
# How the layers' matrices of each stored type are kept by quantize = "auto".
_QUANTIZATION = {Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q8_0: "int8"}
_LAYER_NAMES = {  # GGUF name in block i -> Hugging Face name under model.layers.{i}.
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in
       [("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")] for p in ("weight", "bias")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # GGUFValueType -> struct format; 8 is a string, 9 an array


@attrs.frozen
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order, [out, in]
    type: Q
    offset: int  # bytes from the start of the file
    nbytes: int


class _Header:
    """A GGUF header parsed from its first bytes: ``meta`` and ``tensors``. Arrays longer
    than 512 items (the vocabulary) stand for their length unless ``full_arrays``.
    struct.error: the bytes end first."""

    def __init__(self, data: bytes, file_size: int, full_arrays: bool = False) -> None:
        self.data, self.pos, self.full_arrays = data, 4, full_arrays
        if (version := self.take("<I")) not in (2, 3):
            raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_keys = self.take("<Q"), self.take("<Q")
        self.meta = {self.string(): self.value(self.take("<I")) for _ in range(n_keys)}
        table = [self.tensor() for _ in range(n_tensors)]
        align = self.meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(align) is not int or align < 1 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of 2")
        start = -(-self.pos // align) * align
        self.tensors = {t.name: attrs.evolve(t, offset=start + t.offset) for t in table}
        if late := [t.name for t in self.tensors.values() if t.offset + t.nbytes > file_size]:
            raise ValueError(f"truncated: tensor {late[0]} ends past the end of the file")

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise struct.error("a string runs past the end")
        self.pos += n
        return self.data[self.pos - n:self.pos].decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == 9:  # llama.cpp reads none either
                raise ValueError("an array of arrays")
            if count > 512 and etype in _FORMATS:  # a fixed-size array in one jump
                start, self.pos = self.pos, self.pos + count * struct.calcsize(_FORMATS[etype])
                if not self.full_arrays:
                    return count
                if self.pos > len(self.data):
                    raise struct.error("an array runs past the end")
                return np.frombuffer(self.data, np.dtype(_FORMATS[etype]), count,
                                     start).tolist()
            items = [self.value(etype) for _ in range(count)]  # strings are walked
            return items if count <= 512 or self.full_arrays else count
        value = self.take(_FORMATS[vtype])  # KeyError: an unknown type
        # float32 metadata as the decimal it was written from (1e-05, not 9.99999974e-06)
        return float(str(np.float32(value))) if vtype == 6 else value

    def tensor(self) -> _Tensor:
        name, n_dims = self.string(), self.take("<I")
        dims = [self.take("<Q") for _ in range(n_dims)]
        ttype = Q(self.take("<I"))
        block, type_size = GGML_QUANT_SIZES[ttype]
        return _Tensor(name, tuple(reversed(dims)), ttype, self.take("<Q"),
                       math.prod(dims) // block * type_size)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata value of a GGUF file, arrays whole (the tokenizer's vocabulary and
    merges): 0.2 s for the embedded model's 49k tokens, where gguf.GGUFReader, which makes
    numpy views of every item, took 3.8 s."""
    return _read_header(Path(path), full_arrays=True).meta


def _read_header(path: Path, full_arrays: bool = False) -> _Header:
    """The header alone, read in growing slices (it grows with the vocabulary: 2 MB for 49k
    tokens, about 8 MB for 128k)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        for length in (1 << 22, 1 << 26, size):
            f.seek(0)
            try:
                return _Header(f.read(length), size, full_arrays)
            except struct.error:
                if length >= size:
                    raise CheckpointError(f"{path}: truncated or corrupt GGUF header") from None
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt GGUF header ({e})") from None
    raise AssertionError("unreachable")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo the converter's ``permute``: within each head, rows ordered (pair, 2) go back to
    (2, pair), i.e. llama.cpp's interleaved rotary pairs back to Hugging Face's two halves."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFFile:
    """An opened GGUF file: ``config``, ``description`` and ``rope_freqs`` (None without a
    rope_freqs.weight), every tensor checked; CheckpointError when this backend cannot read it."""

    def __init__(self, path: Path) -> None:
        self.path, header = path, _read_header(path)
        self.meta, table = header.meta, header.tensors
        self.by_hf = {hf: t for t in table.values() if (hf := _hf_name(t.name)) is not None}
        if extra := [n for n in table if _hf_name(n) is None and n != "rope_freqs.weight"]:
            raise CheckpointError(f"{path}: tensors a Llama-family decoder does not have: "
                                  f"{', '.join(extra[:5])}")
        if "model.embed_tokens.weight" not in self.by_hf:
            raise CheckpointError(f"{path}: missing tensors token_embd.weight")
        self.rope_freqs = self._rope_freqs(table.get("rope_freqs.weight"))
        try:
            self.config = self._config(str(self.meta.get("general.architecture")))
        except (TypeError, ValueError, ZeroDivisionError) as e:  # a value of the wrong type
            raise CheckpointError(f"{path}: metadata of the wrong type ({e})") from None
        check_tensor_names(path, self.config, set(self.by_hf))
        for name, shape in self.config.tensor_shapes().items():
            if (t := self.by_hf[name]).shape != shape:
                raise CheckpointError(f"{path}: {t.name} has shape {list(t.shape)}; the "
                                      f"metadata makes {name} {list(shape)}")
            if t.type not in _GGUF_TYPES:
                raise CheckpointError(
                    f"{path}: tensor {t.name} is {t.type.name}, a type this backend does not "
                    f"read (it reads {', '.join(k.name for k in _GGUF_TYPES)}); requantize the "
                    "file to one of those with llama-quantize")
        self.description = self._describe(list(self.by_hf.values()))
        types = [t.type for t in self.by_hf.values()
                 if len(t.shape) == 2 and t.name not in _GLOBAL_NAMES]
        most = max(set(types), key=types.count)
        self.quantization = _QUANTIZATION.get(most, "none")

    def _rope_freqs(self, t: _Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if t.type != Q.F32 or len(t.shape) != 1:
            raise CheckpointError(f"{self.path}: rope_freqs.weight is not a float32 vector")
        with self.path.open("rb") as f:
            f.seek(t.offset)
            return torch.frombuffer(bytearray(f.read(t.nbytes)), dtype=torch.float32)

    def _config(self, arch: str) -> LlamaConfig:
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: architecture {arch!r} is not one this backend "
                                  f"runs ({', '.join(ARCHITECTURES)})")
        m = self.meta

        def key(name: str, default: Any = None) -> Any:
            if (value := m.get(f"{arch}.{name}", default)) is None or isinstance(value, list):
                raise CheckpointError(f"{self.path}: metadata {arch}.{name} is "
                                      f"{'missing' if value is None else 'per layer'}")
            return value

        heads, hidden = key("attention.head_count"), key("embedding_length")
        theta = float(key("rope.freq_base", 10000.0))
        head_dim = key("attention.key_length", m.get(f"{arch}.rope.dimension_count",
                                                     hidden // heads))
        # Llama 3 instruct ends a turn with eot and text with eos: both stop generation
        eos = list(dict.fromkeys(m[k] for k in ("tokenizer.ggml.eos_token_id",
                                                "tokenizer.ggml.eot_token_id",
                                                "tokenizer.ggml.eom_token_id") if k in m))
        return LlamaConfig(
            architecture=arch, vocab_size=self.by_hf["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden, intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"), num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=theta,
            rope_scaling=self._rope_scaling(arch, theta, head_dim),
            max_position_embeddings=key("context_length"),
            tie_word_embeddings="lm_head.weight" not in self.by_hf,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in self.by_hf,
            bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos[0] if len(eos) == 1 else (eos or None))

    def _rope_scaling(self, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
        m, p = self.meta, f"{arch}.rope.scaling."
        if self.rope_freqs is not None:
            return _llama3_scaling(self.path, self.rope_freqs, theta, head_dim,
                                   m.get(p + "original_context_length"))
        kind = m.get(p + "type", "none")
        if kind == "none":
            return None
        if kind not in ("linear", "yarn") or p + "factor" not in m:
            raise CheckpointError(f"{self.path}: rope scaling {kind!r} (factor "
                                  f"{m.get(p + 'factor')}) is not supported: none, linear, "
                                  "yarn and Llama 3's rope_freqs are")
        if kind == "linear":
            return {"rope_type": "linear", "factor": m[p + "factor"]}
        original = m.get(p + "original_context_length", m.get(f"{arch}.context_length"))
        return {"rope_type": "yarn", "factor": m[p + "factor"],
                "original_max_position_embeddings": original} | {
            k: m[p + f"yarn_{k}"] for k in ("beta_fast", "beta_slow") if p + f"yarn_{k}" in m}

    @staticmethod
    def _describe(ts: list[_Tensor]) -> str:
        def most(of: list[_Tensor]) -> str:
            names = [t.type.name for t in of]
            return max(set(names), key=names.count) if names else "none"

        matrices = [t for t in ts if len(t.shape) == 2 and t.name != "token_embd.weight"]
        embd = next(t.type.name for t in ts if t.name == "token_embd.weight")
        return (f"GGUF: {len(ts)} tensors, {most(matrices)} (token_embd {embd}, "
                f"norms {most([t for t in ts if t.name.endswith('norm.weight')])})")

    def tensors(self, config: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        permuted = config.architecture in _PERMUTED
        for name in config.tensor_shapes():
            t = self.by_hf[name]
            # A plain array, not a memmap: gguf's dequantize slices it per row, and every
            # memmap slice costs a Python object (1.8 of the load's 8 s, profiled).
            raw = np.asarray(data[t.offset:t.offset + t.nbytes])
            if (dtype := _GGUF_TYPES[t.type]) is None:  # rows of blocks -> float32 [out, in]
                rows = raw.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
                tensor = torch.from_numpy(dequantize(rows, t.type).reshape(t.shape))
            else:  # copied out of the read-only map, then seen as its dtype
                tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(t.shape)
            if permuted and ".self_attn.q_proj." in name:
                tensor = _unpermute(tensor, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                tensor = _unpermute(tensor, config.num_kv_heads)
            yield name, tensor



def _llama3_scaling(path: Path, freqs: torch.Tensor, theta: float, head_dim: int,
                    original: int | None) -> dict[str, Any] | None:
    """The llama3 ``rope_scaling`` whose divisors are ``freqs``: Meta's band (1, 4) if it fits,
    else a line fitted to the smooth band. Only the band's edges (wavelengths original /
    low_freq_factor and original / high_freq_factor) matter, so without an original context
    length in the file the converter's default, 8192, serves as well as the true one."""
    f = freqs.double().numpy()
    if len(f) != head_dim // 2:
        raise CheckpointError(f"{path}: rope_freqs.weight has {len(f)} values, not "
                              f"head_dim / 2 = {head_dim // 2}")
    if np.all(f == 1.0):
        return None
    factor, original = float(str(np.float32(f.max()))), int(original or 8192)
    candidates = [(1.0, 4.0)]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    band = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    if band.sum() >= 2:  # 1/f = (1 - s)/factor + s, with s = (original/wavelen - low)/(high - low)
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(original / wavelen[band], s, 1)
        if slope > 0:
            low = -intercept / slope
            candidates += [(round(low, 4), round(low + 1 / slope, 4)), (low, low + 1 / slope)]
    for low, high in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                   "high_freq_factor": float(high), "original_max_position_embeddings": original}
        if torch.allclose(llama3_rope_factors(theta, head_dim, scaling), freqs, rtol=1e-5):
            return scaling
    raise CheckpointError(f"{path}: rope_freqs.weight matches no llama3 rope scaling")
