"""The one reader of GGUF headers: metadata and the tensor table, never the weights.

Both the core's shape reader (``files.read_gguf``) and the torch backend's checkpoint
(``laya_backend_torch.gguf_checkpoint``) read a file's header here and keep their own views of
it. The scan is by hand rather than by ``gguf.GGUFReader``, which parses every vocabulary array
into numpy (about 2 s for a 49k vocabulary) before it gives a single value, and trusts the
counts a file claims: here every length is checked against the bytes left before it is read,
so a hostile file is refused with the field that runs past the end instead of a huge
allocation. ``gguf`` supplies the format's constants.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from laya_core.models.checks import ModelFileError

__all__ = ["GGUFHeader", "GGUFTensor", "HeaderRunsOut", "read_gguf_header"]

# The struct format of one fixed-size value type (strings and arrays are variable).
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Fewest bytes one array item takes (a string: its 8-byte length), to bound a claimed count.
_MIN_ITEM_BYTES = {t: struct.calcsize(f) for t, f in _SCALAR.items()} | {
    GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_GGML_MAX_DIMS = 4
_LENGTH = struct.Struct("<Q")


class HeaderRunsOut(ModelFileError):
    """A header field (or the count it claims) runs past the end of the file: ``detail`` says
    where, and what it would take."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"truncated or corrupt: {detail}")
        self.detail = detail


@attrs.frozen
class GGUFTensor:
    """One entry of the tensor table, as the file states it."""

    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length (numpy's shape reversed)
    type: GGMLQuantizationType
    offset: int  # bytes from the start of the data (``GGUFHeader.data_start``)
    nbytes: int


@attrs.frozen
class GGUFHeader:
    """``metadata`` (an array kept whole, or standing for its length), the tensor table in file
    order, and the byte where the tensors' data starts."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    data_start: int
    file_size: int


def read_gguf_header(path: Path, *, keep_items: int | None = None,
                     skip_prefixes: Sequence[str] = (),
                     floats_as_written: bool = False) -> GGUFHeader:
    """The header of the GGUF file at ``path``; ModelFileError (HeaderRunsOut when a field runs
    past the end) when it is truncated, corrupt or unsafe, OSError when it cannot be read.

    Arrays of more than ``keep_items`` items (None: no limit), and arrays under a key starting
    with one of ``skip_prefixes``, stand for their length. With ``floats_as_written``, a float32
    value is the decimal it was written from (1e-05, not 9.99999974e-06); items of arrays are
    left as stored."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError("not a GGUF file (it does not start with GGUF)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, keep_items, tuple(skip_prefixes), floats_as_written)
            return c.header()


class _Cursor:
    """Reads GGUF header fields, refusing any that would run past the end of the file."""

    def __init__(self, buf: Any, keep_items: int | None, skip_prefixes: tuple[str, ...],
                 floats_as_written: bool) -> None:
        self.buf, self.pos, self.size = buf, 4, len(buf)
        self.keep_items, self.skip_prefixes = keep_items, skip_prefixes
        self.floats_as_written = floats_as_written

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise HeaderRunsOut(
                f"at byte {self.pos}, {what} would take {n} bytes, but only "
                f"{self.size - self.pos} remain (file size {self.size} bytes)")

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

    def strings(self, count: int, keep: bool, key: str) -> list[str]:
        """``count`` strings (a vocabulary: the loop kept tight), or none when not ``keep``."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for _ in range(count):
            if pos + 8 > size:
                break
            (n,) = _LENGTH.unpack_from(buf, pos)
            if n > size - pos - 8:
                break
            if keep:
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace"))
            pos += 8 + n
        else:
            self.pos = pos
            return out
        self.pos = pos  # the failed item: the cursor says where and what
        self.string(f"the value of {key}")
        raise AssertionError("unreachable")

    def value(self, vtype: int, key: str, keep: bool = True) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"the value of {key}")
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q", f"the length of {key}")
            if etype == GGUFValueType.ARRAY:  # llama.cpp reads no nested arrays either
                raise ModelFileError(f"corrupt: {key} is an array of arrays")
            self.need(count * _MIN_ITEM_BYTES.get(etype, 1), f"the {count} items of {key}")
            keep = keep and (self.keep_items is None or count <= self.keep_items)
            if etype == GGUFValueType.STRING:
                items = self.strings(count, keep, key)
            elif etype in _SCALAR:  # fixed-size items in one jump
                dtype, start = np.dtype(_SCALAR[GGUFValueType(etype)]), self.pos
                self.pos += count * dtype.itemsize
                items = (np.frombuffer(self.buf, dtype, count, start).tolist()
                         if keep and count else [])
            else:
                raise ModelFileError(f"corrupt: {key} has unknown value type {etype}")
            return items if keep else count  # a skipped array stands for its length
        if vtype not in _SCALAR:
            raise ModelFileError(f"corrupt: {key} has unknown value type {vtype}")
        value = self.unpack(_SCALAR[GGUFValueType(vtype)], f"the value of {key}")
        if self.floats_as_written and vtype == GGUFValueType.FLOAT32:
            return float(str(np.float32(value)))
        return value

    def header(self) -> GGUFHeader:
        version = self.unpack("<I", "the version")
        if version not in (2, 3):
            raise ModelFileError(f"GGUF version {version}; Laya reads versions 2 and 3")
        n_tensors = self.unpack("<Q", "the tensor count")
        n_kv = self.unpack("<Q", "the key count")
        self.need(n_kv * 13, f"{n_kv} metadata keys")  # a key: 8 B length, 1+ B name, 4 B type
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = self.string(f"the name of metadata key {i}")
            if key in meta:  # llama.cpp refuses these too
                raise ModelFileError(f"corrupt: metadata key {key} appears twice")
            vtype = self.unpack("<I", f"the type of {key}")
            meta[key] = self.value(vtype, key, not key.startswith(self.skip_prefixes))
        self.need(n_tensors * 24, f"{n_tensors} tensor descriptions")  # name, dims, type, offset
        tensors = [self.tensor(i) for i in range(n_tensors)]
        alignment = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
            raise ModelFileError(f"general.alignment is {alignment!r}; it must be a power of 2")
        data_start = -(-self.pos // alignment) * alignment
        for t in tensors:
            if (end := data_start + t.offset + t.nbytes) > self.size:
                raise ModelFileError(f"truncated: tensor {t.name} ends at byte {end}, but "
                                     f"the file has {self.size} bytes")
        return GGUFHeader(meta, tensors, data_start, self.size)

    def tensor(self, i: int) -> GGUFTensor:
        name = self.string(f"the name of tensor {i}")
        n_dims = self.unpack("<I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= _GGML_MAX_DIMS:
            raise ModelFileError(f"corrupt: tensor {name} has {n_dims} dimensions")
        dims = tuple(self.unpack("<Q", f"the dimensions of tensor {name}")
                     for _ in range(n_dims))
        code = self.unpack("<I", f"the type of tensor {name}")
        offset = self.unpack("<Q", f"the offset of tensor {name}")
        try:
            ttype = GGMLQuantizationType(code)
            block, size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise ModelFileError(f"corrupt: tensor {name} has unknown type {code}") from None
        if dims[0] % block:
            raise ModelFileError(f"corrupt: tensor {name}'s rows of {dims[0]} are not whole "
                                 f"{ttype.name} blocks of {block}")
        return GGUFTensor(name, dims, ttype, offset, math.prod(dims) // block * size)
