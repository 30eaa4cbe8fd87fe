"""Makes damaged or hostile copies of a GGUF file, for tests of the readers that must refuse them.

Each function reads ``src`` (normally the embedded SmolLM2 file, :func:`embedded`) and writes
an edited copy to ``dst``, returning ``dst``. The header is parsed here independently of
``laya_core.models.files``, so a bug in the reader under test cannot hide in its fixtures.
"""

from __future__ import annotations

import mmap
import shutil
import struct
from pathlib import Path
from typing import Any

from laya_core.builtin.model_paths import embedded_file

# GGUF value types (gguf.constants.GGUFValueType) and their struct formats.
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KINDS = {"u32": 4, "i32": 5, "f32": 6, "u64": 10, "bool": 7}
_ALIGNMENT = 32
_HEADER = 24  # magic, version, tensor count, key count


def embedded() -> Path:
    """The embedded SmolLM2-135M-Instruct file, the source of every hostile copy."""
    return Path(embedded_file("smollm2-135m-instruct"))


def truncated(src: Path, dst: Path, n_bytes: int) -> Path:
    """The first ``n_bytes`` of ``src``."""
    with src.open("rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


def with_version(src: Path, dst: Path, version: int) -> Path:
    """``src`` with its GGUF version field set to ``version``."""
    shutil.copyfile(src, dst)
    with dst.open("r+b") as f:
        f.seek(4)
        f.write(struct.pack("<I", version))
    return dst


def with_huge_string_length(src: Path, dst: Path, length: int = 2**62) -> Path:
    """``src`` with the length of its first metadata key's name set to ``length`` bytes."""
    shutil.copyfile(src, dst)
    with dst.open("r+b") as f:
        f.seek(_HEADER)
        f.write(struct.pack("<Q", length))
    return dst


def _skip_value(buf: mmap.mmap, pos: int, vtype: int) -> int:
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _FORMATS:
            return pos + count * struct.calcsize(_FORMATS[etype])
        for _ in range(count):
            pos = _skip_value(buf, pos, etype)
        return pos
    return pos + struct.calcsize(_FORMATS[vtype])


def _encode(key: str, value: object, kind: str) -> bytes:
    name = key.encode()
    head = struct.pack("<Q", len(name)) + name
    if kind == "str":
        text = str(value).encode()
        return head + struct.pack("<IQ", _STRING, len(text)) + text
    if kind == "strs":
        texts = [str(v).encode() for v in value]  # type: ignore[attr-defined]
        return head + struct.pack("<IIQ", _ARRAY, _STRING, len(texts)) + b"".join(
            struct.pack("<Q", len(t)) + t for t in texts)
    vtype = _KINDS[kind]
    return head + struct.pack("<I", vtype) + struct.pack(_FORMATS[vtype], value)


def _split(buf: mmap.mmap) -> tuple[int, dict[str, bytes], bytes, int]:
    """The tensor count, each key's encoded entry, the tensor table and where data starts."""
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, entries = _HEADER, {}
    for _ in range(n_kv):
        start = pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        key = bytes(buf[pos + 8 : pos + 8 + n]).decode()
        vtype = struct.unpack_from("<I", buf, pos + 8 + n)[0]
        pos = _skip_value(buf, pos + 12 + n, vtype)
        entries[key] = bytes(buf[start:pos])
    table_start = pos
    for _ in range(n_tensors):
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        pos += 4 + 8 * n_dims + 4 + 8
    data_start = -(-pos // _ALIGNMENT) * _ALIGNMENT
    return n_tensors, entries, bytes(buf[table_start:pos]), data_start


def with_metadata(src: Path, dst: Path, key: str, value: object, kind: str = "u32") -> Path:
    """``src`` with metadata ``key`` set to ``value`` as ``kind`` (u32, i32, f32, u64, bool,
    str, strs: an array of strings), added when absent; ``kind="delete"`` removes the key."""
    with src.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        version = struct.unpack_from("<I", buf, 4)[0]
        n_tensors, entries, table, data_start = _split(buf)
        if kind == "delete":
            entries.pop(key)
        else:
            entries[key] = _encode(key, value, kind)
        header = (b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(entries))
                  + b"".join(entries.values()) + table)
        with dst.open("wb") as out:
            out.write(header + b"\0" * (-len(header) % _ALIGNMENT))
            out.write(buf[data_start:])
    return dst


# SmolLM2's control tokens 3-12 (<repo_name> .. <jupyter_text>, never in its chats) as
# Llama 3's, Mistral's and gpt-oss's markup, which each is one control token of theirs.
FAMILY_CONTROLS = {3: "<|python_tag|>", 4: "[TOOL_CALLS]", 5: "[ARGS]", 6: "<|start|>",
                   7: "<|channel|>", 8: "<|constrain|>", 9: "<|message|>", 10: "<|call|>",
                   11: "<|end|>", 12: "<|return|>"}


def with_tokens(src: Path, dst: Path, renamed: dict[int, str]) -> Path:
    """``src`` with the tokens of ``renamed`` (id -> text) spelt otherwise: renaming a
    control token gives a model another family's control tokens, its weights unchanged."""
    from gguf import GGUFReader

    field = GGUFReader(src).fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    for token, text in renamed.items():
        tokens[token] = text
    return with_metadata(src, dst, "tokenizer.ggml.tokens", tokens, "strs")


def small_llama(**changes: Any) -> dict[str, Any]:
    """The metadata of a two-layer Llama as the header checks read it (a key set to None is
    left out), for tests of those checks without a file."""
    meta: dict[str, Any] = {
        "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 64,
        "llama.embedding_length": 8, "llama.attention.head_count": 2,
        "tokenizer.ggml.tokens": 10}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}
