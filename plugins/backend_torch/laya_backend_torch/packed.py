"""GPTQ and AWQ checkpoints: the projections as their tools packed them, unpacked as stored.

A Hugging Face folder whose ``config.json`` carries a ``quantization_config`` keeps each
layer's seven projections (q, k, v, o, gate, up, down) as integers in groups of inputs, with
a scale and a zero point per group and output. Both formats mean the same matrix::

    W[o, i] = scales[g[i], o] * (q[o, i] - zeros[g[i], o])

and differ in how they pack it:

- **GPTQ**: ``qweight`` int32 [in / per_word, out] (nibble ``k`` of word row ``r`` is input
  ``per_word * r + k``), ``qzeros`` int32 [groups, out / per_word] (nibble ``k`` of column
  ``c`` is output ``per_word * c + k``), stored less one unless ``checkpoint_format`` is
  "gptq_v2", ``scales`` [groups, out], and ``g_idx`` [in], the group of each input: under
  act-order (``desc_act``) the inputs of one group are scattered, so it is always read.
- **AWQ** ("gemm" version): ``qweight`` int32 [in, out / per_word] and ``qzeros`` int32
  [groups, out / per_word], eight 4-bit outputs per word in the order 0, 2, 4, 6, 1, 3, 5,
  7; zeros as they are (all 8 without ``zero_point``); no ``g_idx``: input ``i`` is in group
  ``i // group_size``. Its activation scaling is folded into the norms already.

:class:`GroupQuant` holds one matrix unpacked (q, scales, zeros, g_idx); the model hands it
to the 4-bit kernel as stored (``quant.Int4Linear.from_groups``) or dequantizes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

# The seven projections of a layer that the tools quantize; embeddings and norms stay dense.
PROJECTIONS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down"))
SUPPORTED = ("GPTQ (4 or 8 bits, symmetric or not, v1 or gptq_v2 zeros, act-order), "
             "AWQ gemm (4 bits, with or without zero points)")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble k holds output column _AWQ_ORDER[k]


class PackedFormatError(ValueError):
    """A quantization_config this backend does not run; the message says what it found and
    what is supported."""


@attrs.frozen
class PackedFormat:
    """What ``quantization_config`` says about the packed projections."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # inputs per group (-1 in the file: one group of every input)
    sym: bool
    desc_act: bool = False
    zeros_as_stored: bool = False  # gptq_v2: qzeros hold the zero itself, not zero - 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def describe(self) -> str:
        kind = "symmetric" if self.sym else "asymmetric"
        order = ", act-order" if self.desc_act else ""
        return f"{self.method.upper()} {self.bits}-bit, group size {self.group_size}, {kind}{order}"

    def tensor_shapes(self, name: str, out_features: int, in_features: int
                      ) -> dict[str, tuple[int, ...]]:
        """The packed tensors that stand for ``name`` (``...q_proj``) [out, in]."""
        groups = in_features // self.group_size
        if self.method == "gptq":
            return {f"{name}.qweight": (in_features // self.per_word, out_features),
                    f"{name}.qzeros": (groups, out_features // self.per_word),
                    f"{name}.scales": (groups, out_features),
                    f"{name}.g_idx": (in_features,)}
        return {f"{name}.qweight": (in_features, out_features // self.per_word),
                f"{name}.qzeros": (groups, out_features // self.per_word),
                f"{name}.scales": (groups, out_features)}

    def unpack(self, tensors: Mapping[str, torch.Tensor], name: str) -> GroupQuant:
        """``name``'s matrix from its packed tensors (shapes already checked)."""
        if self.method == "gptq":
            q = _unpack_rows(tensors[f"{name}.qweight"], self.bits)  # [in, out]
            zeros = _unpack_columns(tensors[f"{name}.qzeros"], self.bits)  # [groups, out]
            if not self.zeros_as_stored:
                zeros = (zeros + 1) & ((1 << self.bits) - 1)
            g_idx = tensors[f"{name}.g_idx"].to(torch.long)
        else:
            q = _unpack_columns(tensors[f"{name}.qweight"], self.bits, _AWQ_ORDER)
            zeros = _unpack_columns(tensors[f"{name}.qzeros"], self.bits, _AWQ_ORDER)
            g_idx = torch.arange(q.shape[0]) // self.group_size
        return GroupQuant(q.T.contiguous(), tensors[f"{name}.scales"].to(torch.float32),
                          zeros.to(torch.float32), g_idx, self.group_size, self.bits)


def packed_format(qc: Any, where: str) -> PackedFormat:
    """``config.json``'s ``quantization_config``, or PackedFormatError naming what is there."""
    if not isinstance(qc, Mapping):
        raise PackedFormatError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    bits, group = qc.get("bits"), qc.get("group_size", 128)
    found = f"quant_method {method or '(none)'!r}, bits {bits!r}"
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
            raise PackedFormatError(f"{where}: {found}, checkpoint_format {fmt!r} is not "
                                    f"supported; this backend runs {SUPPORTED}")
        packed = PackedFormat("gptq", bits, group, bool(qc.get("sym", True)),
                              bool(qc.get("desc_act", False)), fmt == "gptq_v2")
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise PackedFormatError(f"{where}: {found}, version {version!r} is not "
                                    f"supported; this backend runs {SUPPORTED}")
        packed = PackedFormat("awq", 4, group, not qc.get("zero_point", True))
    else:
        raise PackedFormatError(f"{where}: {found} is not supported; this backend runs "
                                f"{SUPPORTED}")
    if type(group) is not int or group < 1:  # -1: a whole row in one group, rare; refused
        raise PackedFormatError(f"{where}: group_size {group!r} is not supported (a positive "
                                "number of inputs per group)")
    return packed


def _entries(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, cols] -> uint8 [rows, cols, per_word]: each word's entries, entry k in
    bits ``bits * k`` and up. Through the words' bytes (little-endian), so that nothing
    wider than a byte an entry is made: a 7B model's largest matrix would otherwise pass
    through 4-byte copies of every entry several times while it loads."""
    data = words.contiguous().view(torch.uint8).view(*words.shape, 4)  # byte j: bits 8j..
    if bits == 8:
        return data
    return torch.stack((data & 15, data >> 4), dim=-1).view(*words.shape, 8)


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, cols] -> [rows * per_word, cols]: word row r holds rows per_word*r + k."""
    values = _entries(words, bits)  # [rows, cols, per_word]
    return values.permute(0, 2, 1).reshape(-1, words.shape[1])


def _unpack_columns(words: torch.Tensor, bits: int,
                    order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 [rows, cols] -> [rows, cols * per_word]: nibble k of word column c is column
    per_word*c + order[k] (order: 0, 1, 2, ... unless given)."""
    values = _entries(words, bits)
    if order is not None:
        values = values[:, :, torch.argsort(torch.tensor(order))]
    return values.reshape(words.shape[0], -1)


@attrs.frozen(eq=False)
class GroupQuant:
    """One unpacked matrix [out, in]: ``W[o, i] = scales[g[i], o] * (q[o, i] - zeros[g[i], o])``."""

    q: torch.Tensor  # uint8 [out, in], 0 .. 2^bits - 1
    scales: torch.Tensor  # float32 [groups, out]
    zeros: torch.Tensor  # float32 [groups, out], integers
    g_idx: torch.Tensor  # long [in]: each input's group
    group_size: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [out, in]."""
        scales, zeros = self.scales[self.g_idx].T, self.zeros[self.g_idx].T  # [out, in]
        return scales * (self.q.to(torch.float32) - zeros)

    def grouped_inputs(self) -> torch.Tensor | None:
        """None when input i is in group i // group_size (the kernel's layout); else the
        input order that makes every group contiguous (act-order), each group whole."""
        natural = torch.arange(self.q.shape[1]) // self.group_size
        if torch.equal(self.g_idx, natural):
            return None
        order = torch.argsort(self.g_idx, stable=True)
        if not torch.equal(self.g_idx[order], natural):  # groups of unequal sizes
            raise PackedFormatError("g_idx puts other than group_size inputs in a group")
        return order

    @staticmethod
    def stacked(parts: Sequence[GroupQuant]) -> GroupQuant:
        """Matrices with the same inputs stacked on their outputs (q, k and v; gate and up),
        which needs their inputs grouped alike."""
        first = parts[0]
        if any(not torch.equal(p.g_idx, first.g_idx) or p.group_size != first.group_size
               or p.bits != first.bits for p in parts[1:]):
            raise PackedFormatError("projections that share their input group it differently")
        return GroupQuant(torch.cat([p.q for p in parts]),
                          torch.cat([p.scales for p in parts], dim=1),
                          torch.cat([p.zeros for p in parts], dim=1), first.g_idx,
                          first.group_size, first.bits)
