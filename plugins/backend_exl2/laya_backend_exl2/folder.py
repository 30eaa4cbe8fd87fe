"""An ExLlama model folder read from its headers: which quantization it holds, and where its
weights' bytes are (each layer's, the token embedding's, the output head's).

EXL2 folders (exllamav2's ``convert.py -cf``) say ``quantization_config.quant_method =
"exl2"`` in config.json; an older one only shows it by its tensors (``*.q_weight``). EXL3
folders say ``"exl3"``, GPTQ folders ``"gptq"`` (or have AutoGPTQ's ``quantize_config.json``
and ``*.qweight`` tensors). Sizes come from the safetensors headers, never the weights.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import attrs

from laya_core.models.checks import ModelFileError

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
_MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header is JSON; a 70B model's is about 2 MiB
# What each format is, for messages.
FORMAT_NAMES = {"exl2": "EXL2", "exl3": "EXL3", "gptq": "GPTQ", "awq": "AWQ",
                None: "unquantized"}


@attrs.frozen
class Folder:
    """A model folder's quantization and its weights' bytes by place."""

    path: Path
    config: dict[str, Any]
    format: str | None  # "exl2", "exl3", "gptq", "awq", another quant_method, or None
    layer_bytes: tuple[int, ...]  # each repeating layer's tensors, in order
    embedding_bytes: int  # the token embedding, which the libraries keep in host RAM
    head_bytes: int  # the output head, the final norm and whatever else is not a layer
    has_head: bool  # an lm_head tensor; else the head is the embedding (tied), copied

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    @property
    def gpu_weights_bytes(self) -> int:
        """What the GPUs hold of the file: all but the token embedding."""
        return sum(self.layer_bytes) + self.head_bytes


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFileError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER_BYTES:
            raise ModelFileError(f"{file}: its header claims {size} bytes; not a safetensors "
                                 "file, or a damaged one")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ModelFileError(f"{file}: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: its header is not a table of tensors")
    return header


def tensor_sizes(folder: Path) -> dict[str, int]:
    """Every tensor's bytes, by name, over the folder's safetensors files."""
    sizes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, t in _header(file).items():
            if name == "__metadata__":
                continue
            try:
                start, end = t["data_offsets"]
                sizes[name] = int(end) - int(start)
            except (KeyError, TypeError, ValueError):
                raise ModelFileError(f"{file}: tensor {name!r} has no data_offsets") from None
    return sizes


def format_of(folder: Path, config: dict[str, Any], names: set[str] | dict[str, int]) -> str | None:
    qc = config.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method:
        return method
    if any(n.endswith(".q_weight") for n in names):
        return "exl2"  # converted without -cf: no signature in config.json
    if (folder / "quantize_config.json").is_file() and any(n.endswith(".qweight") for n in names):
        return "gptq"  # AutoGPTQ's own file
    return None


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{folder} has no config.json") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {folder / 'config.json'}: {e}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{folder / 'config.json'} is not a JSON object")
    return config


def read_folder(path: str | Path) -> Folder:
    """The folder's format and byte counts; ModelFileError when it cannot be read."""
    folder = Path(path)
    config = read_config(folder)
    try:
        sizes = tensor_sizes(folder)
    except OSError as e:
        raise ModelFileError(f"cannot read the weights in {folder}: {e}") from None
    n_layers = int(config.get("num_hidden_layers") or 0)
    layers, embedding, head = [0] * n_layers, 0, 0
    for name, size in sizes.items():
        m = _LAYER_RE.search(name)
        if m and int(m.group(1)) < n_layers:
            layers[int(m.group(1))] += size
        elif name.endswith(_EMBEDDING_SUFFIXES):
            embedding += size
        else:
            head += size
    return Folder(folder, config, format_of(folder, config, sizes), tuple(layers), embedding,
                  head, any(n.startswith("lm_head.") for n in sizes))


def folder_problem(path: str, formats: tuple[str, ...], backend: str) -> str | None:
    """Why ``path`` is no folder ``backend`` loads (its ``formats``), or None."""
    folder = Path(path)
    wanted = " or ".join(FORMAT_NAMES[f] for f in formats)
    if not folder.is_dir():
        return f"{path} is not a folder; the {backend} backend loads an {wanted} model " \
               "folder (config.json, tokenizer.json, *.safetensors)"
    if not any(folder.glob("*.safetensors")):
        return f"{path} has no .safetensors weights"
    if not (folder / "tokenizer.json").is_file():
        return f"{path} has no tokenizer.json (the fast tokenizer's file, which Laya " \
               "tokenizes prompts with)"
    try:
        config = read_config(folder)
        found = format_of(folder, config, tensor_sizes(folder))
    except (ModelFileError, OSError) as e:
        return str(e)
    if found in formats:
        return None
    other = {"exl3": "exl3", "exl2": "exl2", "gptq": "exl2 or torch"}.get(found or "", "torch")
    return f"{path} holds {FORMAT_NAMES.get(found, found)} weights, not {wanted}: serve it " \
           f"with the {other} backend"
