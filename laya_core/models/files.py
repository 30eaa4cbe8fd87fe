"""A model's shape and weight size read from file headers only, never from the weights.

GGUF files are scanned header-first (metadata and the tensor table); a Hugging Face folder is
read from ``config.json`` plus the safetensors headers when the weights are there, so a 7B plan
can be made from ``config.json`` alone. ``gguf`` supplies the format's constants; its own reader
parses every vocabulary array into numpy (about 2 s for a 49k vocabulary), far more than a plan
needs, so the scan here reads only what it uses.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from laya_core.models.checks import ModelFileError, check_metadata, vocab_size
from laya_core.models.pooling import pooling_of_folder, pooling_of_gguf

__all__ = ["ModelFileError", "ModelShape", "model_file_problem", "read_gguf", "read_hf_folder",
           "read_shape"]

# Bytes of one element of a value type in GGUF metadata (strings and arrays are variable).
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Fewest bytes one array item takes (a string: its 8-byte length), to bound a claimed count.
_MIN_ITEM_BYTES = {t: struct.calcsize(f) for t, f in _SCALAR.items()} | {
    GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_KEEP_ITEMS = 4096  # longer arrays stand for their length: per-layer ones have <= 512 items
_GGML_MAX_DIMS = 4
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1,
                "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


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
    # The pooling the model declares for embeddings ("mean", "cls", "last"), or None
    # (laya_core/models/pooling.py).
    pooling: str | None = None

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, over all layers (GQA-aware)."""
        return self.n_layers * self.n_kv_heads * (self.head_dim_k + self.head_dim_v)


class _Cursor:
    """Reads GGUF header fields, refusing any that would run past the end of the file."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                f"truncated or corrupt: at byte {self.pos}, {what} would take {n} bytes, but "
                f"only {self.size - self.pos} remain (file size {self.size} bytes)")

    def unpack(self, fmt: str, what: str = "a header field") -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str = "a string") -> str:
        n = self.unpack("<Q", f"the length of {what}")
        self.need(n, what)
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"the value of {key}")
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q", f"the length of {key}")
            if etype == GGUFValueType.ARRAY:  # llama.cpp reads no nested arrays either
                raise ModelFileError(f"corrupt: {key} is an array of arrays")
            self.need(count * _MIN_ITEM_BYTES.get(etype, 1), f"the {count} items of {key}")
            keep = keep and count <= _KEEP_ITEMS
            if etype in _SCALAR and not keep:  # skip fixed-size arrays in one jump
                self.pos += count * struct.calcsize(_SCALAR[etype])
                return count
            items = [self.value(etype, keep, key) for _ in range(count)]
            return items if keep else count  # a skipped array stands for its length
        if vtype not in _SCALAR:
            raise ModelFileError(f"corrupt: {key} has unknown value type {vtype}")
        return self.unpack(_SCALAR[GGUFValueType(vtype)], f"the value of {key}")


def read_gguf(path: Path) -> ModelShape:
    """The shape of a GGUF file; ModelFileError when it is truncated, corrupt or unsafe."""
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError("not a GGUF file (it does not start with GGUF)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                c = _Cursor(buf)
                c.pos = 4
                meta, tensors = _read_header(c)
        arch = check_metadata(meta, {t.name: t.dims for t in tensors})
        return _shape_from_gguf(meta, arch, tensors)
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


@attrs.frozen
class _Tensor:
    name: str
    dims: list[int]  # ggml order: dims[0] is the row length
    type: GGMLQuantizationType
    nbytes: int


def _read_header(c: _Cursor) -> tuple[dict[str, Any], list[_Tensor]]:
    """Metadata (vocabulary arrays as their lengths) and the tensor table; checks the data."""
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        raise ModelFileError(f"GGUF version {version}; Laya reads versions 2 and 3")
    n_tensors, n_kv = c.unpack("<Q", "the tensor count"), c.unpack("<Q", "the key count")
    c.need(n_kv * 13, f"{n_kv} metadata keys")  # a key: 8 B length, 1+ B name, 4 B type
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"the name of metadata key {i}")
        if key in meta:  # llama.cpp refuses these too
            raise ModelFileError(f"corrupt: metadata key {key} appears twice")
        vtype = c.unpack("<I", f"the type of {key}")
        meta[key] = c.value(vtype, not key.startswith("tokenizer.ggml."), key)  # skip vocab
    c.need(n_tensors * 24, f"{n_tensors} tensor descriptions")  # name, dims, type, offset
    table = [_read_tensor(c, i) for i in range(n_tensors)]
    alignment = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise ModelFileError(f"general.alignment is {alignment!r}; it must be a power of 2")
    data_start = -(-c.pos // alignment) * alignment
    for (tensor, offset) in table:
        end = data_start + offset + tensor.nbytes
        if end > c.size:
            raise ModelFileError(f"truncated: tensor {tensor.name} ends at byte {end}, but "
                                 f"the file has {c.size} bytes")
    return meta, [t for t, _ in table]


def _read_tensor(c: _Cursor, i: int) -> tuple[_Tensor, int]:
    name = c.string(f"the name of tensor {i}")
    n_dims = c.unpack("<I", f"the dimension count of tensor {name}")
    if not 1 <= n_dims <= _GGML_MAX_DIMS:
        raise ModelFileError(f"corrupt: tensor {name} has {n_dims} dimensions")
    dims = [c.unpack("<Q", f"the dimensions of tensor {name}") for _ in range(n_dims)]
    code = c.unpack("<I", f"the type of tensor {name}")
    offset = c.unpack("<Q", f"the offset of tensor {name}")
    try:
        ttype = GGMLQuantizationType(code)
        block, size = GGML_QUANT_SIZES[ttype]
    except (ValueError, KeyError):
        raise ModelFileError(f"corrupt: tensor {name} has unknown type {code}") from None
    n = math.prod(dims)
    if dims[0] % block:
        raise ModelFileError(f"corrupt: tensor {name}'s rows of {dims[0]} are not whole "
                             f"{ttype.name} blocks of {block}")
    return _Tensor(name, dims, ttype, n // block * size), offset


def _shape_from_gguf(meta: dict[str, Any], arch: str, tensors: list[_Tensor]) -> ModelShape:
    """The shape of metadata that ``check_metadata`` passed."""
    att = f"{arch}.attention"
    n_heads = meta[f"{att}.head_count"]
    n_heads = max(n_heads) if isinstance(n_heads, list) else n_heads
    n_kv = meta.get(f"{att}.head_count_kv", n_heads)
    n_kv = max(n_kv) if isinstance(n_kv, list) else n_kv
    hidden = meta[f"{arch}.embedding_length"]
    head_k = meta.get(f"{att}.key_length", hidden // n_heads)
    matrix_types = {t.type.name.lower() for t in tensors
                    if len(t.dims) >= 2 and not t.name.startswith("token_embd.")}
    return ModelShape(
        architecture=arch, n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
        n_kv_heads=n_kv, head_dim_k=head_k, head_dim_v=meta.get(f"{att}.value_length", head_k),
        hidden_size=hidden, vocab_size=vocab_size(meta, arch),
        n_ctx_train=meta[f"{arch}.context_length"],
        weights_bytes=sum(t.nbytes for t in tensors),
        weights_source=f"GGUF tensor table ({len(tensors)} tensors)",
        matrix_types=frozenset(matrix_types),
        pooling=pooling_of_gguf(meta.get(f"{arch}.pooling_type")))


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
    if min(heads, hidden, n_layers) < 1:
        raise ModelFileError(f"{config_path}: num_attention_heads ({heads}), hidden_size "
                             f"({hidden}) and num_hidden_layers ({n_layers}) must be >= 1")
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
        weights_source=source, pooling=pooling_of_folder(folder))


def model_file_problem(path: str | Path) -> str | None:
    """What is wrong with a model path (said to the user), or None: it must be a regular file
    or a folder, and a GGUF file's header must pass :func:`read_gguf`'s checks."""
    p = Path(path)
    if not p.exists():
        return f"no such file: {p}"
    if not (p.is_file() or p.is_dir()):
        return f"{p} is not a regular file or a folder"
    try:
        with p.open("rb") as f:
            gguf = f.read(4) == b"GGUF"
        if gguf:
            read_gguf(p)
    except ModelFileError as e:
        return str(e)
    except OSError:
        return None  # a folder, or unreadable: the backend's own check says which
    return None


def read_shape(path: str | Path) -> ModelShape:
    """The shape of a GGUF file or a Hugging Face model folder, from headers only."""
    p = Path(path)
    if p.is_dir():
        return read_hf_folder(p)
    if not p.is_file():
        raise ModelFileError(f"no such file or folder: {p}")
    return read_gguf(p)
