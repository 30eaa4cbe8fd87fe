"""GGUF files as the torch backend reads them: the header scanned for its metadata and tensor
table, the config in Hugging Face's terms, and tensors under Hugging Face names and shapes.

llama.cpp's converter renames every tensor and permutes Q and K rows for its interleaved
rotary (Q by ``n_head``, K by ``n_head_kv``), which ``GGUFFile.tensors()`` undoes, and stores
Llama 3's rotary as per-frequency divisors (``rope_freqs.weight``), which are mapped back to a
llama3 ``rope_scaling``. The header is read by laya_core's reader (``models.gguf_header``, in
0.2 s where ``gguf.GGUFReader`` takes 2 s for 49k tokens): the memory planner calls
``read_config`` for each model, and the tokenizer reads the vocabulary through
``read_metadata``. ``checkpoint.open_checkpoint`` is the entry point; this module is imported
when it meets a GGUF file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from laya_backend_torch.checkpoint import (
    ARCHITECTURES,
    CheckpointError,
    LlamaConfig,
    check_tensor_names,
    llama3_rope_factors,
)
from laya_backend_torch.packed import GroupQuant
from laya_core.models.checks import ModelFileError
from laya_core.models.gguf_header import HeaderRunsOut, read_gguf_header

__all__ = ["GGUFFile"]

# Written by the converter's LlamaModel, which permutes Q and K; Qwen2 keeps the rotate-half
# (NeoX) rotary of Hugging Face, so its rows are stored as they are.
_PERMUTED = {"llama", "mistral"}
_GGUF_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16,
               Q.Q8_0: None, Q.Q4_0: None, Q.Q4_1: None}  # None: dequantized to float32
# 4-bit block types a layer's matrices are kept in as stored (four_bit_groups).
_FOUR_BIT = (Q.Q4_0, Q.Q4_1)
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
_KEEP_ITEMS = 512  # longer arrays (the vocabulary) stand for their length, but in read_metadata


@attrs.frozen
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order, [out, in]
    type: Q
    offset: int  # bytes from the start of the file
    nbytes: int


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata value of a GGUF file, arrays whole (the tokenizer's vocabulary and
    merges): 0.2 s for the embedded model's 49k tokens, where gguf.GGUFReader, which makes
    numpy views of every item, took 3.8 s."""
    return _read_header(Path(path), full_arrays=True)[0]


def _read_header(path: Path, full_arrays: bool = False) -> tuple[dict[str, Any],
                                                                 dict[str, _Tensor]]:
    """The metadata (float32 values as the decimals they were written from) and the tensors
    by name in this backend's terms; CheckpointError when the header is damaged."""
    try:
        header = read_gguf_header(path, keep_items=None if full_arrays else _KEEP_ITEMS,
                                  floats_as_written=True)
    except HeaderRunsOut as e:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({e.detail})") from None
    except ModelFileError as e:
        raise CheckpointError(f"{path}: corrupt GGUF header ({e})") from None
    return header.metadata, {
        t.name: _Tensor(t.name, tuple(reversed(t.dims)), t.type, header.data_start + t.offset,
                        t.nbytes) for t in header.tensors}


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
        self.path, (self.meta, table) = path, _read_header(path)
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

    def tensors(self, config: LlamaConfig, as_stored: bool = False
                ) -> Iterator[tuple[str, Any]]:
        """Each tensor by its Hugging Face name, Q and K rows back in Hugging Face's order;
        quantized ones dequantized to float32, except with ``as_stored`` a layer's 4-bit
        matrix (Q4_0, Q4_1), which comes as its blocks hold it (``GroupQuant``: its 4-bit
        values, and each block's scale and offset) for the int4 kernel to take as they are:
        no error added, and no time spent dequantizing and quantizing again."""
        from gguf.quants import dequantize

        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        permuted = config.architecture in _PERMUTED
        for name in config.tensor_shapes():
            t = self.by_hf[name]
            # A plain array, not a memmap: gguf's dequantize slices it per row, and every
            # memmap slice costs a Python object (1.8 of the load's 8 s, profiled).
            raw = np.asarray(data[t.offset:t.offset + t.nbytes])
            tensor: Any
            if as_stored and t.type in _FOUR_BIT and name.endswith("_proj.weight") \
                    and len(t.shape) == 2:
                tensor = four_bit_groups(raw, t.shape, t.type)
            elif t.type == Q.Q8_0:
                tensor = torch.from_numpy(eight_bit_floats(raw, t.shape))
            elif (dtype := _GGUF_TYPES[t.type]) is None:  # rows of blocks -> float32 [out, in]
                rows = raw.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
                tensor = torch.from_numpy(dequantize(rows, t.type).reshape(t.shape))
            else:  # copied out of the read-only map, then seen as its dtype
                tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(t.shape)
            if permuted and ".self_attn.q_proj." in name:
                tensor = _unpermute_any(tensor, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                tensor = _unpermute_any(tensor, config.num_kv_heads)
            yield name, tensor


def eight_bit_floats(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A Q8_0 tensor as float32: blocks of a float16 scale d and 32 int8 values q, each
    ``d x q``; in one pass over all blocks (gguf's routine goes row group by row group in
    Python: 0.7 s for the embedded model's 49,152 x 576 embedding)."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    np.multiply(out, d, out=out)
    return out.reshape(shape)


def four_bit_groups(raw: np.ndarray, shape: tuple[int, ...], kind: Q) -> GroupQuant:
    """A Q4_0 or Q4_1 matrix [out, in] as stored: 32 inputs per block, a block of Q4_0 a
    float16 scale d and 16 bytes of 4-bit values (``w = d x (q - 8)``), of Q4_1 a scale d, a
    minimum m and the values (``w = d x q + m``). Byte j of a block holds value j in its low
    half and value 16 + j in its high half."""
    out_features, in_features = shape
    header = 2 if kind == Q.Q4_0 else 4
    blocks = raw.reshape(out_features, in_features // 32, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, groups]
    packed = blocks[..., header:]
    q = np.concatenate((packed & 15, packed >> 4), axis=-1).reshape(out_features, in_features)
    if kind == Q.Q4_0:
        zeros = np.full_like(d, 8.0)
    else:  # d x q + m = d x (q - z) for z = -m / d; a block of one value has d = 0
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        d = np.maximum(d, np.float32(1e-12)) if not (d > 0).all() else d
        zeros = -m / d
    return GroupQuant(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d.T)),
                      torch.from_numpy(np.ascontiguousarray(zeros.T)),
                      torch.arange(in_features) // 32, 32, 4)


def _unpermute_any(w: Any, n_head: int) -> Any:
    """:func:`_unpermute` of a dense matrix, or of a GroupQuant's rows (its outputs)."""
    if not isinstance(w, GroupQuant):
        return _unpermute(w, n_head)
    rows = _unpermute(torch.arange(w.q.shape[0])[:, None], n_head)[:, 0]
    return GroupQuant(w.q[rows], w.scales[:, rows], w.zeros[:, rows], w.g_idx, w.group_size,
                      w.bits)



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
