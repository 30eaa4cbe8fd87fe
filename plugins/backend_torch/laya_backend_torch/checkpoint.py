"""Checkpoints as the torch backend reads them: a GGUF file or a Hugging Face folder, seen as
one ``LlamaConfig`` and a stream of tensors under Hugging Face names and shapes.

Both formats come out the same so that the model code knows one layout: llama.cpp's converter
renames every tensor and permutes Q and K rows for its interleaved rotary (Q by ``n_head``, K
by ``n_head_kv``), which ``tensors()`` undoes. A GGUF header is scanned here rather than by
``gguf.GGUFReader``, which parses every vocabulary string into numpy (about 2 s for 49k tokens)
before it gives a single value; the memory planner calls ``read_config`` for each model.
"""

from __future__ import annotations

import contextlib
import json
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

__all__ = ["Checkpoint", "CheckpointError", "LlamaConfig", "llama3_rope_factors",
           "open_checkpoint", "read_config"]

# architecture (GGUF general.architecture, Hugging Face model_type) -> transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
# Written by the converter's LlamaModel, which permutes Q and K; Qwen2 keeps the rotate-half
# (NeoX) rotary of Hugging Face, so its rows are stored as they are.
_PERMUTED = {"llama", "mistral"}
_GGUF_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16,
               Q.Q8_0: None, Q.Q4_0: None, Q.Q4_1: None}  # None: dequantized to float32
_LAYER_NAMES = {  # GGUF name in block i -> Hugging Face name under model.layers.{i}.
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in
       [("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")] for p in ("weight", "bias")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class CheckpointError(Exception):
    """A checkpoint this backend cannot read; the message names the file and what is wrong."""


@attrs.frozen
class LlamaConfig:
    """A Llama-family decoder's shape, in Hugging Face's terms whatever file it came from."""

    architecture: str = attrs.field(validator=attrs.validators.in_(ARCHITECTURES))
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Hugging Face form ({"rope_type": "llama3", "factor": 8.0, ...}); None for plain rotary.
    rope_scaling: dict[str, Any] | None = attrs.field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (always for Qwen2; Llama's o_proj too)
    bos_token_id: int | None
    eos_token_id: int | list[int] | None = attrs.field(hash=False)

    def __attrs_post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                               "num_layers", "num_heads", "num_kv_heads",
                                               "head_dim", "max_position_embeddings")}
        if bad := [f"{k}={v!r}" for k, v in sizes.items() if type(v) is not int or v < 1]:
            raise CheckpointError(f"sizes must be positive integers: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_heads {self.num_heads} is not a multiple of "
                                  f"num_kv_heads {self.num_kv_heads}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise CheckpointError("a qwen2 model has q/k/v biases (attention_bias)")

    def hf_config(self) -> dict[str, Any]:
        """A config.json transformers loads as the architecture's *ForCausalLM; the rotary in
        the legacy ``rope_theta`` + ``rope_scaling`` keys, which old and new versions read."""
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}
        if self.architecture == "llama":
            return cfg | {"attention_bias": self.attention_bias, "mlp_bias": False}
        # Mistral's sliding window is 4096 tokens when the key is missing
        return cfg | {"sliding_window": None, "use_sliding_window": False}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of this config, Hugging Face name -> shape ([out, in] for matrices), in
        the order ``Checkpoint.tensors()`` yields them: embeddings, layer by layer, the final
        norm, and the output head unless it is tied."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        o_bias = self.attention_bias and self.architecture == "llama"  # as HF Llama has it
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            for proj, out, n_in, bias in (("q", q, h, self.attention_bias),
                                          ("k", kv, h, self.attention_bias),
                                          ("v", kv, h, self.attention_bias), ("o", h, q, o_bias)):
                shapes[f"{p}self_attn.{proj}_proj.weight"] = (out, n_in)
                if bias:
                    shapes[f"{p}self_attn.{proj}_proj.bias"] = (out,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


@attrs.define
class Checkpoint:
    """An opened checkpoint: its config, and its tensors read one at a time on demand.

    Every name, shape and tensor type was checked when it was opened, so ``tensors()`` fails
    only on I/O. ``rope_freqs`` is the divisor per rotary frequency [head_dim // 2] that a GGUF
    file stores for Llama 3 rotary (llama.cpp divides each inverse frequency by it); the
    config's ``rope_scaling`` then holds the Hugging Face llama3 parameters recovered from it,
    checked to give the same divisors. None for other files.
    """

    config: LlamaConfig
    path: str
    description: str  # for logs: "GGUF: 272 tensors, Q4_1 (token_embd Q8_0, norms F32)"
    rope_freqs: torch.Tensor | None
    _source: _GGUFFile | _HFFolder

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor, in the order ``tensors()`` yields."""
        return self.config.tensor_shapes()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) in ``shapes`` order, each read when it is reached:
        quantized GGUF tensors dequantized to float32, F32/F16/BF16 kept in their dtype, GGUF
        Q and K (weights and biases) un-permuted."""
        return self._source.tensors(self.config)


def open_checkpoint(path: str) -> Checkpoint:
    """A GGUF file (it starts with ``GGUF``) or a Hugging Face folder (config.json and
    *.safetensors, sharded or not); CheckpointError when this backend cannot read it."""
    s = _open(path)
    return Checkpoint(s.config, str(path), s.description, s.rope_freqs, s)


def read_config(path: str) -> LlamaConfig:
    """The config alone, from headers (and a GGUF file's rope_freqs, 256 bytes at most)."""
    return _open(path).config


def _open(path: str) -> _GGUFFile | _HFFolder:
    p = Path(path)
    if p.is_dir():
        return _HFFolder(p)
    if not p.is_file():
        raise CheckpointError(f"no such file or folder: {p}")
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{p} is neither a GGUF file (it does not start with GGUF) "
                                  "nor a Hugging Face folder")
    return _GGUFFile(p)


def _check_names(path: Path, config: LlamaConfig, names: set[str]) -> None:
    expected = config.tensor_shapes()
    if missing := [n for n in expected if n not in names]:
        raise CheckpointError(f"{path}: missing tensors {', '.join(missing[:5])}")
    if extra := sorted(names - set(expected) - {"lm_head.weight"}):  # a tied copy is fine
        raise CheckpointError(f"{path}: tensors a Llama-family decoder does not have: "
                              f"{', '.join(extra[:5])}")


# --- GGUF ---------------------------------------------------------------------------------

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
    """A GGUF header parsed from its first bytes: ``meta`` (arrays longer than 512 items, the
    vocabulary, stand for their length) and ``tensors``. struct.error: the bytes end first."""

    def __init__(self, data: bytes, file_size: int) -> None:
        self.data, self.pos = data, 4
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
            if count > 512 and etype in _FORMATS:  # skip a fixed-size array in one jump
                self.pos += count * struct.calcsize(_FORMATS[etype])
                return count
            items = [self.value(etype) for _ in range(count)]  # strings are walked
            return items if count <= 512 else count
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


def _read_header(path: Path) -> _Header:
    """The header alone, read in growing slices (it grows with the vocabulary: 2 MB for 49k
    tokens, about 8 MB for 128k)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        for length in (1 << 22, 1 << 26, size):
            f.seek(0)
            try:
                return _Header(f.read(length), size)
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


class _GGUFFile:
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
        _check_names(path, self.config, set(self.by_hf))
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
            raw = data[t.offset:t.offset + t.nbytes]
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


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """The divisors [head_dim // 2] llama.cpp's converter stores as ``rope_freqs.weight`` for a
    llama3 ``rope_scaling``, computed as it does (float32 frequencies, wavelength bands)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor",
                                                     "high_freq_factor"))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    factors = torch.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return torch.where(wavelen < original / high, 1.0, factors).to(torch.float32)


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


# --- Hugging Face folder ------------------------------------------------------------------

class _HFFolder:
    rope_freqs = None

    def __init__(self, folder: Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.path, self.files = folder, dict[str, Path]()  # tensor name -> its file
        cfg = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json", missing_ok=True)
        dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape)
        try:
            with contextlib.ExitStack() as stack:
                for file in _weight_files(folder):
                    f = stack.enter_context(safe_open(file, framework="pt"))
                    slices = {n: f.get_slice(n) for n in f.keys()
                              if not n.endswith("rotary_emb.inv_freq")}  # old buffers
                    self.files |= dict.fromkeys(slices, file)
                    dtypes |= {n: (s.get_dtype(), tuple(s.get_shape()))
                               for n, s in slices.items()}
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{folder}: cannot read its safetensors files: {e}") from None
        self.config = _hf_config(folder / "config.json", cfg, gen, "lm_head.weight" in dtypes)
        if not self.files:
            raise CheckpointError(f"{folder} has no *.safetensors weights")
        _check_names(folder, self.config, set(self.files))
        for name, shape in self.config.tensor_shapes().items():
            if dtypes[name][1] != shape:
                raise CheckpointError(f"{self.files[name]}: {name} has shape "
                                      f"{list(dtypes[name][1])}; config.json makes it "
                                      f"{list(shape)}")
        kinds = [d for d, _ in dtypes.values()]
        n_files = len(set(self.files.values()))
        self.description = (f"safetensors: {len(dtypes)} tensors in {n_files} file"
                            f"{'s' * (n_files > 1)}, {max(set(kinds), key=kinds.count)}")

    def tensors(self, config: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for name in config.tensor_shapes():
                if (file := self.files[name]) not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                yield name, handles[file].get_tensor(name)


def _weight_files(folder: Path) -> list[Path]:
    """The files the index names, else model.safetensors, else every *.safetensors (Mistral's
    folders hold a consolidated.safetensors under other names beside the shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else sorted(folder.glob("*.safetensors"))


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise CheckpointError(f"{path.parent} has no {path.name}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def _hf_config(where: Path, cfg: dict[str, Any], gen: dict[str, Any],
               has_head: bool) -> LlamaConfig:
    classes = {cls: arch for arch, cls in ARCHITECTURES.items()}
    arch = classes.get((cfg.get("architectures") or [""])[0], cfg.get("model_type"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: {cfg.get('architectures')} is not a model this backend "
                              f"runs ({', '.join(ARCHITECTURES.values())})")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: only a SiLU MLP without biases is supported")
    try:
        params = dict(cfg.get("rope_parameters") or {})  # transformers 5's form, theta inside
        theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in dict(cfg.get("rope_scaling") or params).items()
                   if k != "rope_theta"}
        if "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        return LlamaConfig(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or not has_head,
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
            eos_token_id=gen.get("eos_token_id", cfg.get("eos_token_id")))
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where} lacks or mangles {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
