"""A model's shape and weight size read from file headers only, never from the weights.

A GGUF file's header (metadata and the tensor table) is read by ``gguf_header``, vocabulary
arrays standing for their lengths; a Hugging Face folder is read from ``config.json`` plus the
safetensors headers when the weights are there, so a 7B plan can be made from ``config.json``
alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from laya_core.models.checks import ModelFileError, check_metadata, vocab_size
from laya_core.models.gguf_header import GGUFTensor, read_gguf_header
from laya_core.models.pooling import pooling_of_folder, pooling_of_gguf

__all__ = ["MetadataCheck", "ModelFileError", "ModelShape", "model_file_problem", "read_gguf",
           "read_hf_folder", "read_shape"]

# A backend's own check of a GGUF file's metadata and tensor dimensions (by tensor name),
# run after the core's: a problem its library would fail on, or None
# (Backend.check_model_metadata).
MetadataCheck = Callable[[Mapping[str, Any], Mapping[str, Sequence[int]]], "str | None"]

_KEEP_ITEMS = 4096  # longer arrays stand for their length: per-layer ones have <= 512 items
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
    # The output head's element type (the token embedding's where the head is tied to it);
    # None when unknown.
    head_type: str | None = None
    # The pooling the model declares for embeddings ("mean", "cls", "last"), or None
    # (laya_core/models/pooling.py).
    pooling: str | None = None
    # Bytes of each repeating layer's tensors, in order, and of the output head (a tied
    # head: the token embedding, which a library offloading it copies), where the file
    # tells them (GGUF's tensor table); empty: not known, and a plan that offloads layers
    # takes the weights as evenly spread.
    layer_bytes: tuple[int, ...] = ()
    output_bytes: int = 0
    output_tied: bool = False  # the head is the token embedding (offloaded: a copy)

    def layer_weights(self, index: int) -> int:
        """Layer ``index``'s bytes (an even share of the weights where not known)."""
        if self.layer_bytes:
            return self.layer_bytes[index]
        return self.weights_bytes // max(1, self.n_layers + 2)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, over all layers (GQA-aware)."""
        return self.n_layers * self.n_kv_heads * (self.head_dim_k + self.head_dim_v)


def read_gguf(path: Path, check: MetadataCheck | None = None) -> ModelShape:
    """The shape of a GGUF file; ModelFileError when it is truncated, corrupt or unsafe, or
    when ``check`` (a backend's own) finds a problem."""
    try:
        header = read_gguf_header(path, keep_items=_KEEP_ITEMS,
                                  skip_prefixes=("tokenizer.ggml.",))  # the vocabulary
        meta, tensors = header.metadata, header.tensors
        dims = {t.name: t.dims for t in tensors}
        arch = check_metadata(meta, dims)
        if check is not None and (problem := check(meta, dims)):
            raise ModelFileError(problem)
        return _shape_from_gguf(meta, arch, tensors)
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


def _shape_from_gguf(meta: dict[str, Any], arch: str, tensors: list[GGUFTensor]) -> ModelShape:
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
    n_layers = meta[f"{arch}.block_count"]
    layers = [0] * n_layers
    by_name = {t.name: t.nbytes for t in tensors}
    for t in tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() \
                and int(parts[1]) < n_layers:
            layers[int(parts[1])] += t.nbytes
    output = by_name.get("output.weight", by_name.get("token_embd.weight", 0))
    head = next((t for t in tensors if t.name == "output.weight"),
                next((t for t in tensors if t.name == "token_embd.weight"), None))
    return ModelShape(
        architecture=arch, n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
        n_kv_heads=n_kv, head_dim_k=head_k, head_dim_v=meta.get(f"{att}.value_length", head_k),
        hidden_size=hidden, vocab_size=vocab_size(meta, arch),
        n_ctx_train=meta[f"{arch}.context_length"],
        weights_bytes=sum(t.nbytes for t in tensors),
        weights_source=f"GGUF tensor table ({len(tensors)} tensors)",
        matrix_types=frozenset(matrix_types),
        head_type=None if head is None else head.type.name.lower(),
        pooling=pooling_of_gguf(meta.get(f"{arch}.pooling_type")),
        layer_bytes=tuple(layers), output_bytes=output,
        output_tied="output.weight" not in by_name)


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


def model_file_problem(path: str | Path, check: MetadataCheck | None = None) -> str | None:
    """What is wrong with a model path (said to the user), or None: it must be a regular file
    or a folder, and a GGUF file's header must pass :func:`read_gguf`'s checks (with the
    backend's ``check``)."""
    p = Path(path)
    if not p.exists():
        return f"no such file: {p}"
    if not (p.is_file() or p.is_dir()):
        return f"{p} is not a regular file or a folder"
    try:
        with p.open("rb") as f:
            gguf = f.read(4) == b"GGUF"
        if gguf:
            read_gguf(p, check)
    except ModelFileError as e:
        return str(e)
    except OSError:
        return None  # a folder, or unreadable: the backend's own check says which
    return None


def read_shape(path: str | Path, check: MetadataCheck | None = None) -> ModelShape:
    """The shape of a GGUF file or a Hugging Face model folder, from headers only; a GGUF
    file's metadata also passes ``check``, a backend's own, where given."""
    p = Path(path)
    if p.is_dir():
        return read_hf_folder(p)
    if not p.is_file():
        raise ModelFileError(f"no such file or folder: {p}")
    return read_gguf(p, check)
