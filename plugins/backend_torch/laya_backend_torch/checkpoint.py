"""Checkpoints as the torch backend reads them: a GGUF file or a Hugging Face folder, seen as
one ``LlamaConfig`` and a stream of tensors under Hugging Face names and shapes.

Both formats come out the same so that the model code knows one layout. This module is the
entry point (``open_checkpoint``, ``read_config``) and reads Hugging Face folders; GGUF files,
whose tensors llama.cpp's converter renames and permutes, are read by ``gguf_checkpoint``,
imported only when a GGUF file is met (it imports this module's config and errors).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from laya_backend_torch.gguf_checkpoint import GGUFFile

__all__ = ["Checkpoint", "CheckpointError", "LlamaConfig", "llama3_rope_factors",
           "open_checkpoint", "read_config", "read_header"]

# architecture (GGUF general.architecture, Hugging Face model_type) -> transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


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
    _source: GGUFFile | _HFFolder

    @property
    def quantization(self) -> str:
        """How the file stores most layer matrices, as a ``quantize`` value: "int4" for 4-bit
        GGUF types, "int8" for Q8_0, "none" for floats (and every Hugging Face folder)."""
        return str(getattr(self._source, "quantization", "none"))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor, in the order ``tensors()`` yields."""
        return self.config.tensor_shapes()

    def tensors(self, as_stored: bool = False) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) in ``shapes`` order, each read when it is reached:
        quantized GGUF tensors dequantized to float32, F32/F16/BF16 kept in their dtype, GGUF
        Q and K (weights and biases) un-permuted. ``as_stored``: a GGUF layer's 4-bit
        matrix comes as its blocks hold it (a ``packed.GroupQuant``), for the int4 kernel;
        a packed folder's projections always do."""
        if isinstance(self._source, _HFFolder):
            return self._source.tensors(self.config)
        return self._source.tensors(self.config, as_stored)


def open_checkpoint(path: str) -> Checkpoint:
    """A GGUF file (it starts with ``GGUF``) or a Hugging Face folder (config.json and
    *.safetensors, sharded or not); CheckpointError when this backend cannot read it."""
    s = _open(path)
    return Checkpoint(s.config, str(path), s.description, s.rope_freqs, s)


def read_config(path: str) -> LlamaConfig:
    """The config alone, from headers (and a GGUF file's rope_freqs, 256 bytes at most)."""
    return _open(path).config


def read_header(path: str) -> tuple[LlamaConfig, str]:
    """The config and ``Checkpoint.quantization``, from one read of the headers."""
    source = _open(path)
    return source.config, getattr(source, "quantization", "none")


def _open(path: str) -> GGUFFile | _HFFolder:
    p = Path(path)
    if p.is_dir():
        return _HFFolder(p)
    if not p.is_file():
        raise CheckpointError(f"no such file or folder: {p}")
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{p} is neither a GGUF file (it does not start with GGUF) "
                                  "nor a Hugging Face folder")
    from laya_backend_torch.gguf_checkpoint import GGUFFile

    return GGUFFile(p)


def check_tensor_names(path: Path, config: LlamaConfig | dict[str, tuple[int, ...]],
                       names: set[str]) -> None:
    """CheckpointError unless ``names`` (Hugging Face names) are exactly the tensors of
    ``config`` (or those names), but for a tied model's copy of the output head; ``path``
    for the message."""
    expected = config if isinstance(config, dict) else config.tensor_shapes()
    if missing := [n for n in expected if n not in names]:
        raise CheckpointError(f"{path}: missing tensors {', '.join(missing[:5])}")
    if extra := sorted(names - set(expected) - {"lm_head.weight"}):  # a tied copy is fine
        raise CheckpointError(f"{path}: tensors a Llama-family decoder does not have: "
                              f"{', '.join(extra[:5])}")


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


# --- Hugging Face folder ------------------------------------------------------------------

class _HFFolder:
    rope_freqs = None
    quantization = "none"

    def __init__(self, folder: Path) -> None:
        from safetensors import SafetensorError, safe_open

        from laya_backend_torch.packed import PackedFormatError, packed_format

        self.path, self.files = folder, dict[str, Path]()  # tensor name -> its file
        cfg = _read_json(folder / "config.json")
        self.packed = None  # a GPTQ or AWQ checkpoint's format (laya_backend_torch/packed.py)
        if cfg.get("quantization_config") is not None:
            try:
                self.packed = packed_format(cfg["quantization_config"],
                                            str(folder / "config.json"))
            except PackedFormatError as e:
                raise CheckpointError(str(e)) from None
            self.quantization = "int4" if self.packed.bits == 4 else "int8"
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
        expected = self._stored_shapes()
        check_tensor_names(folder, expected, set(self.files))
        for name, shape in expected.items():
            if dtypes[name][1] != shape:
                raise CheckpointError(f"{self.files[name]}: {name} has shape "
                                      f"{list(dtypes[name][1])}; config.json makes it "
                                      f"{list(shape)}")
        kinds = [d for d, _ in dtypes.values()]
        n_files = len(set(self.files.values()))
        self.description = (f"safetensors: {len(dtypes)} tensors in {n_files} file"
                            f"{'s' * (n_files > 1)}, {max(set(kinds), key=kinds.count)}"
                            + (f"; layers {self.packed.describe()}" if self.packed else ""))

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors the folder must hold: the config's, with each packed projection's
        ``.weight`` replaced by its format's tensors (``packed.PackedFormat``)."""
        from laya_backend_torch.packed import PROJECTIONS

        shapes = self.config.tensor_shapes()
        if self.packed is None:
            return shapes
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            base = name.removesuffix(".weight")
            if name.startswith("model.layers.") and base.split(".", 3)[-1] in PROJECTIONS:
                if shape[1] % self.packed.group_size or shape[0] % self.packed.per_word:
                    raise CheckpointError(
                        f"{self.path}: {name} [{shape[0]}, {shape[1]}] cannot be packed in "
                        f"groups of {self.packed.group_size} inputs and {self.packed.per_word} "
                        "values a word")
                out |= self.packed.tensor_shapes(base, shape[0], shape[1])
            else:
                out[name] = shape
        return out

    def tensors(self, config: LlamaConfig) -> Iterator[tuple[str, Any]]:
        """Each tensor of ``config``; a packed projection as one ``packed.GroupQuant``."""
        from safetensors import safe_open

        stored = self._stored_shapes()
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def read(name: str) -> torch.Tensor:
                if (file := self.files[name]) not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                # A copy of its own: safetensors hands out views of the file's mapping, and
                # one kept as it is (a norm, an embedding already in the compute dtype) would
                # keep the whole file mapped and resident after the load (measured: the
                # file's size in RSS above the plan).
                return handles[file].get_tensor(name).clone()

            for name in config.tensor_shapes():
                if name in stored:
                    yield name, read(name)
                    continue
                assert self.packed is not None
                base = name.removesuffix(".weight")
                parts = {n: read(n) for n in stored if n.startswith(base + ".")}
                matrix = self.packed.unpack(parts, base)
                try:
                    matrix.grouped_inputs()
                except ValueError as e:
                    raise CheckpointError(f"{self.files[base + '.qweight']}: {base}: {e}; "
                                          "each group must hold group_size inputs") from None
                yield name, matrix


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
        # transformers 5's form, theta inside
        params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
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
