"""A model's shape and weight size read from file headers only, never from the weights.

GGUF files are scanned header-first (metadata and the tensor table); a Hugging Face folder is
read from ``config.json`` plus the safetensors headers when the weights are there, so a 7B plan
can be made from ``config.json`` alone. ``gguf`` supplies the format's constants; its own reader
parses every vocabulary array into numpy (about 2 s for a 49k vocabulary), far more than a plan
needs, so the scan here reads only what it uses.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# Bytes of one element of a value type in GGUF metadata (strings and arrays are variable).
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1,
                "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


class ModelFileError(ValueError):
    """The file is not a model Laya can read the shape of."""


@attrs.frozen
class ModelShape:
    """What memory planning needs to know about a model."""

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    hidden_size: int
    vocab_size: int
    n_ctx_train: int
    weights_bytes: int
    weights_source: str  # how weights_bytes was obtained
    # Element types of the weight matrices (GGUF type names in lower case, "q4_0"), leaving
    # out the token embedding, which is looked up rather than multiplied; empty when unknown.
    matrix_types: frozenset[str] = frozenset()

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, over all layers (GQA-aware)."""
        return self.n_layers * self.n_kv_heads * (self.head_dim_k + self.head_dim_v)


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALAR and not keep:  # skip fixed-size arrays in one jump
                self.pos += count * struct.calcsize(_SCALAR[etype])
                return count
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else count  # a skipped array stands for its length
        return self.unpack(_SCALAR[GGUFValueType(vtype)])


def read_gguf(path: Path) -> ModelShape:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelFileError(f"{path} is not a GGUF file")
        c = _Cursor(buf)
        c.pos = 4
        version = c.unpack("<I")
        if version < 2:
            raise ModelFileError(f"{path} is GGUF version {version}; version 2 or later is needed")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            vtype = c.unpack("<I")
            keep = not key.startswith("tokenizer.ggml.")  # vocabulary arrays: skip
            meta[key] = c.value(vtype, keep)
        weights = 0
        matrix_types = set()
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            ttype = GGMLQuantizationType(c.unpack("<I"))
            c.unpack("<Q")
            block, size = GGML_QUANT_SIZES[ttype]
            n = 1
            for d in dims:
                n *= d
            weights += n // block * size
            if len(dims) >= 2 and not name.startswith("token_embd."):
                matrix_types.add(ttype.name.lower())
    shape = _shape_from_gguf(meta, weights, n_tensors, path)
    return attrs.evolve(shape, matrix_types=frozenset(matrix_types))


def _shape_from_gguf(meta: dict[str, Any], weights: int, n_tensors: int, path: Path) -> ModelShape:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path} has no general.architecture")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path} lacks {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    n_kv = get("attention.head_count_kv", n_heads)
    n_kv = max(n_kv) if isinstance(n_kv, list) else int(n_kv)
    head_k = int(get("attention.key_length", hidden // n_heads))
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens")
    return ModelShape(
        architecture=arch, n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
        head_dim_k=head_k, head_dim_v=int(get("attention.value_length", head_k)),
        hidden_size=hidden, vocab_size=int(vocab) if vocab else 0,
        n_ctx_train=int(get("context_length")), weights_bytes=weights,
        weights_source=f"GGUF tensor table ({n_tensors} tensors)")


def _safetensors_bytes(folder: Path) -> tuple[int, int]:
    """Bytes of all tensors in the folder's safetensors files, from their headers; and files."""
    total, files = 0, sorted(folder.glob("*.safetensors"))
    for file in files:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(end - start for name, t in header.items() if name != "__metadata__"
                     for start, end in [t["data_offsets"]])
    return total, len(files)


def _estimated_llama_params(cfg: dict[str, Any], n_kv: int, head_dim: int) -> int:
    """Parameters of a Llama-style decoder from its config (embeddings, attention, MLP, norms)."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, inter = cfg["num_attention_heads"], cfg["intermediate_size"]
    attention = hidden * heads * head_dim * 2 + hidden * n_kv * head_dim * 2
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return int(vocab * hidden + cfg["num_hidden_layers"] * per_layer + hidden + lm_head)


def read_hf_folder(folder: Path) -> ModelShape:
    config_path = folder / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
    except FileNotFoundError:
        raise ModelFileError(f"{folder} has no config.json") from None
    except (KeyError, ValueError, TypeError) as e:
        raise ModelFileError(f"{config_path} lacks or mangles {e}") from None
    n_kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    weights, n_files = _safetensors_bytes(folder)
    if n_files:
        source = f"safetensors headers ({n_files} files)"
    else:
        dtype = str(cfg.get("torch_dtype", "float16"))
        params = _estimated_llama_params(cfg, n_kv, head_dim)
        weights = params * _DTYPE_BYTES.get(dtype, 2)
        source = f"estimated from config.json: {params / 1e9:.2f}B parameters in {dtype}"
    return ModelShape(
        architecture=str((cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]),
        n_layers=n_layers, n_heads=heads, n_kv_heads=n_kv, head_dim_k=head_dim,
        head_dim_v=head_dim, hidden_size=hidden, vocab_size=int(cfg.get("vocab_size", 0)),
        n_ctx_train=int(cfg.get("max_position_embeddings", 4096)), weights_bytes=weights,
        weights_source=source)


def read_shape(path: str | Path) -> ModelShape:
    """The shape of a GGUF file or a Hugging Face model folder, from headers only."""
    p = Path(path)
    if p.is_dir():
        return read_hf_folder(p)
    if not p.is_file():
        raise ModelFileError(f"no such file or folder: {p}")
    return read_gguf(p)
