"""What ``laya serve|check|plan SOURCE`` was given: a manifest, or a model to serve alone.

The answer comes from the file's content, not its name: a GGUF file starts with ``GGUF``, a
manifest is UTF-8 TOML. Anything else is refused with what it looks like and what to do.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Literal

import attrs

from laya_core.config.table import ManifestError

MAX_MANIFEST_BYTES = 4 * 2**20
_SNIFF_BYTES = 16
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._:/-]+")


@attrs.frozen
class Source:
    kind: Literal["manifest", "model"]
    path: str  # a file or folder path, or a name such as embedded:smollm2-135m-instruct


def _sniff(path: Path) -> bytes:
    """The first bytes of a regular file, without waiting on a FIFO or device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError("", f"{path} is not a regular file or folder; give a manifest, "
                                "a GGUF model file or a model folder")
        return os.read(fd, _SNIFF_BYTES)
    finally:
        os.close(fd)


def _binary_kind(head: bytes) -> str | None:
    """What a binary file that is neither GGUF nor a manifest looks like, when known."""
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 2**30:
        return ("a safetensors weights file; serve the folder that holds it with its "
                "config.json and tokenizer, using a backend that reads Hugging Face folders")
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch checkpoint?); Laya serves GGUF files and model folders"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (a PyTorch .bin checkpoint?); Laya does not load pickles"
    if head.startswith(b"\x1f\x8b"):
        return "gzip-compressed; unpack it first"
    return None


def classify(arg: str) -> Source:
    """Decide what ``arg`` is. Raises :class:`ManifestError` (key "") when it is neither."""
    if arg.startswith("embedded:"):
        return Source("model", arg)
    path = Path(arg).expanduser()
    if path.is_dir():
        return Source("model", str(path.resolve()))
    if not path.exists():
        if path.suffix.lower() == ".toml":
            raise ManifestError("", f"cannot read manifest {path}: no such file")
        # Not here: a name a model-path plugin may know, else resolving it says why.
        return Source("model", arg)
    try:
        head = _sniff(path)
    except OSError as e:
        raise ManifestError("", f"cannot read {path}: {e.strerror or e}") from None
    if head.startswith(b"GGUF"):
        return Source("model", str(path.resolve()))
    if kind := _binary_kind(head):
        raise ManifestError("", f"{path} is {kind}")
    return Source("manifest", str(path))


def check_manifest_text(path: Path) -> None:
    """Refuse, saying what it is, a file that cannot be a manifest before TOML reads it."""
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError("", f"{path} is {size} bytes: too large for a manifest (at most "
                            "4 MiB) and not a GGUF model file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError("", f"{path} is neither a manifest (UTF-8 TOML text: byte "
                            f"{e.start} is invalid) nor a GGUF model file (those start with "
                            "'GGUF'); give a manifest, a .gguf file or a model folder") from None
    stripped = text.lstrip()
    if stripped[:1] in ("{", "["):
        try:
            json.loads(stripped)
        except ValueError:
            return
        raise ManifestError("", f"{path} is JSON; a Laya manifest is TOML (spec/manifest.md)")


def model_name_for(path: str) -> str:
    """The name a model served alone answers to, when --served-model-name is not given:
    the file's stem (``SmolLM2-135M-Instruct.Q4_1``), a folder's name, an embedded name."""
    if path.startswith("embedded:"):
        base = path.split(":", 1)[1]
    else:
        p = Path(path.rstrip("/"))
        base = p.stem if p.suffix.lower() == ".gguf" else p.name
    name = _NAME_CHARS.sub("-", base).lstrip("._:/-")[:128]
    return name or "model"
