"""The model's matrices: dense in the compute dtype, int8 per output channel, or int4 in
groups of 32.

Weight-only int8 halves bfloat16's bytes (and quarters float32's), and decoding on a CPU is
bound by reading the weights once a token. ``torch._weight_int8pack_mm`` multiplies
activations by int8 weights with one scale per output row without dequantizing the matrix;
it is fast with bfloat16 activations and slow with float32 ones (measured on an AMD EPYC
with AVX512-BF16, SmolLM2-135M decoding alone on one thread: 31 tokens/s with bfloat16
activations, 4.7 with float32), so the matrix product always runs in bfloat16, whatever the
model's compute dtype, and its result returns in that dtype.

Weight-only int4 (``Int4Linear``) halves int8's bytes again. Each row's run of 32 inputs has
its own scale and minimum (asymmetric, the layout of GGUF's Q4_1 and of Q4_K's sub-blocks),
so a Q4_1 file's matrices are kept as they were stored rather than rounded a second time:
``w = scale x q + min`` with q in 0..15 is found again exactly from the dequantized values,
whose group minimum is ``min`` and maximum ``min + 15 x scale``. Streaming SmolLM2-135M's
layer matrices from memory for one row took 6.4 ms in int4 against 13.9 ms in int8 (one
thread, AMD EPYC); with the matrices in cache the two kernels cost the same, and the int4
kernel with float32 activations is 30 to 70 times slower, so it too runs in bfloat16.
Where laya_torch_kernels runs on the CPU (AVX2 or AVX-512), ``Q4Linear`` takes int4's place:
the same bytes a weight, multiplied by the kernels in integer sums (twice as fast as
torch's int4 kernel on a decode's rows, Intel Xeon with AMX).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from laya_backend_torch.options import INT4_GROUP
from laya_backend_torch.packed import GroupQuant

# A matrix as the checkpoint gave it: dense, or unpacked from a GPTQ or AWQ folder.
Weight = torch.Tensor | GroupQuant


def _dense_of(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, GroupQuant) else weight


def two_rows(x: torch.Tensor) -> torch.Tensor:
    """A one-row input as two equal rows. A one-row product of 16-bit matrices takes another
    kernel than two or more rows do, whose sums round differently (SmolLM2's down projection
    in bfloat16: 5e-4 apart), so a sequence decoding alone would not get the logits it gets
    in a batch. From two rows up the kernel, and each row's result, stay the same (checked
    for 2 to 512 rows); two cost what one does (80 us for a 1536 x 576 bfloat16 matrix, AMD
    EPYC). float32 is left alone: its kernels change with the row count at several sizes,
    and two rows cost twice one. The int8 product needs no such help: its one-row results
    already equal its many-row ones, and two rows would cost 45% more (99 us against 145
    for 1536 x 576)."""
    return torch.cat((x, x))


# Rows a 16-bit product takes a call where a sequence's logits must be the same bits in any
# batch (``deterministic``). From 2 to 32 rows torch's bfloat16 CPU product gives each row
# the same bits; above 32, on a Xeon with AMX (torch 2.13, oneDNN), it changes kernels, and
# its blocking with the row count: rows of a 576 x 1536 product differed by up to 0.016
# between 33, 64, 300 and 600 rows. Products in chunks of 32 keep every row's bits (on an
# AMD EPYC they were alike at any count already); they cost a 512-row prompt's products
# 3 to 5 times what one call does there, so only the deterministic path chunks.
ALIKE_ROWS = 32


def dense(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


class Linear:
    """``x @ weight.T + bias`` with a dense weight [out, in]; ``chunk_rows`` rows a call at
    most, if set (``ALIKE_ROWS``: the deterministic path's 16-bit products)."""

    chunk_rows = 0
    threads = 1  # a kernel's threads (Q4Linear), as LlamaModel.set_threads says

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    @classmethod
    def of(cls, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Linear:
        return cls(dense(_dense_of(weight), dtype, device),
                   None if bias is None else dense(bias, dtype, device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.weight.dtype != torch.float32:
            return F.linear(two_rows(x), self.weight, self.bias)[:1]
        if self.chunk_rows and x.shape[0] > self.chunk_rows:
            return torch.cat([self(part) for part in x.split(self.chunk_rows)])
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: the embedding lookup of a tied (or input) embedding."""
        return self.weight[ids]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


class Int8Linear(Linear):
    """A weight [out, in] stored as int8 with one scale per output row (symmetric: the
    row's largest magnitude maps to 127)."""

    @classmethod
    def of(cls, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Int8Linear:
        w = _dense_of(weight).to(device=device, dtype=torch.float32)
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, None if bias is None else dense(bias, dtype, device),
                   scales.to(torch.bfloat16).contiguous(), dtype)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(weight, bias)
        self.scales, self.dtype = scales, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The casts only where needed: each call of a tensor method costs a dispatch even
        # when it returns its input, and a decode makes 150 of these products.
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        out = self._product(x if x.is_contiguous() else x.contiguous())
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        return out if self.bias is None else out + self.bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[ids].to(torch.float32)
                * self.scales[ids, None].to(torch.float32)).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.scales.nbytes

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix [out, in] these int8 values stand for (for tests)."""
        return self.weight.float() * self.scales.float()[:, None]


def int4_fits(weight: Weight, device: torch.device, group: int = INT4_GROUP) -> bool:
    """Whether torch's CPU int4 kernel takes this [out, in] matrix in its 64-row blocks:
    rows a multiple of 64 and inputs a multiple of the group (32 to 256 inputs)."""
    return device.type == "cpu" and weight.shape[0] % 64 == 0 \
        and group in (32, 64, 128, 256) and weight.shape[1] % group == 0


class Int4Linear(Int8Linear):
    """A weight [out, in] as 4-bit values in groups of ``group`` inputs, each group with a
    bfloat16 scale and minimum: ``w = scale x q + min``, q in 0..15. The kernel reads the
    pair as ``(q - 8) x scale + zero``, so ``zero = min + 8 x scale`` is what is kept, as
    ``scales`` [groups, out, 2]. A matrix the kernel cannot take (``int4_fits``) is kept in
    int8 instead.

    A GPTQ or AWQ matrix (``from_groups``) keeps its own integers, group size and zero
    points: ``scale x (q - z)`` is the kernel's pair with ``zero = (8 - z) x scale``. Under
    act-order its inputs are reordered so that each group is contiguous, and ``inputs``
    reorders the activations alike at each call."""

    group = INT4_GROUP
    inputs: torch.Tensor | None = None  # the activations' order (act-order), else None

    @classmethod
    def of(cls, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Int8Linear:
        if isinstance(weight, GroupQuant):
            if weight.bits == 4 and int4_fits(weight, device, weight.group_size):
                return cls.from_groups(weight, bias, dtype, device)
            return Int8Linear.of(weight, bias, dtype, device)
        if not int4_fits(weight, device):
            return Int8Linear.of(weight, bias, dtype, device)
        out_features, in_features = weight.shape
        w = weight.to(device=device, dtype=torch.float32).view(out_features, -1, INT4_GROUP)
        low, high = w.amin(dim=2), w.amax(dim=2)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(out_features, in_features), 1)
        scale_zero = torch.stack((scale, low + 8 * scale), dim=2)  # [out, groups, 2]
        return cls(packed, None if bias is None else dense(bias, dtype, device),
                   scale_zero.transpose(0, 1).to(torch.bfloat16).contiguous(), dtype)

    @classmethod
    def from_groups(cls, weight: GroupQuant, bias: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> Int4Linear:
        """A 4-bit GPTQ or AWQ matrix as stored; only its scales and zero offsets are
        rounded, to the kernel's bfloat16."""
        q, order = weight.q, weight.grouped_inputs()
        groups = torch.arange(q.shape[1]) // weight.group_size
        if order is not None:
            q, groups = q[:, order], weight.g_idx[order]
        first = groups[::weight.group_size]  # each kernel group's checkpoint group
        scale, zero = weight.scales[first], weight.zeros[first]  # [groups, out]
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scale_zero = torch.stack((scale, (8 - zero) * scale), dim=2)  # [groups, out, 2]
        linear = cls(packed.to(device), None if bias is None else dense(bias, dtype, device),
                     scale_zero.to(device=device, dtype=torch.bfloat16).contiguous(), dtype)
        linear.group = weight.group_size
        if order is not None:
            linear.inputs = order.to(device)
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.inputs is not None:
            x = x.index_select(-1, self.inputs)
        return super().__call__(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, self.group, self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("an int4 matrix is not an embedding (the model keeps its "
                                  "embedding in int8)")

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix [out, in] these 4-bit values stand for (for tests), in the
        checkpoint's input order."""
        # torch's CPU layout: per 64 rows and per input, 32 bytes, byte j holding row j in
        # its low half and row 32 + j in its high half.
        out_features, in_features = self.weight.shape[0], self.weight.shape[1] * 2
        packed = self.weight.view(out_features // 64, in_features, 32)
        q = torch.cat((packed & 15, packed >> 4), dim=2)  # [blocks, in, 64]
        q = q.transpose(1, 2).reshape(out_features, in_features)
        scale, zero = self.scales.float().unbind(dim=2)  # [groups, out]
        w = (q.float().view(q.shape[0], -1, self.group) - 8) * scale.T[..., None] \
            + zero.T[..., None]
        w = w.view(q.shape[0], -1)
        if self.inputs is not None:
            w = w[:, torch.argsort(self.inputs)]
        return w


def q4_kernels() -> Any:
    """laya_torch_kernels where it runs the 4-bit products on this CPU (``q4_path``: AVX-512
    with VNNI, or AVX2 with FMA and F16C), else None."""
    try:
        import laya_torch_kernels
    except ImportError:
        return None
    path = getattr(laya_torch_kernels, "q4_path", None)
    return laya_torch_kernels if path is not None and path() else None


# float16's largest finite value: a Q4Linear's scales and minimums are kept in float16.
_HALF_MAX = 65504.0


class Q4Linear(Int8Linear):
    """A weight [out, in] in 4-bit groups of 32 inputs, each group with a float16 scale and
    minimum (GGUF's Q4_1: ``w = scale x q + min``, q in 0..15), multiplied by
    laya_torch_kernels (``q4_product``, src/q4.cpp): x in 16-bit steps of each group's
    largest value, exact integer sums, one rounding to bfloat16. A row of the matrix is one
    row of ``weight`` (uint8, ``q4_row_bytes(in)`` bytes): its 4-bit values in the kernel's
    order (``q4_order``), then the groups' scales, then their minimums; 0.625 bytes a weight,
    as Int4Linear. A Q4_1 file's blocks are kept exactly (float16 is what the file stores).

    It takes Int4Linear's place where the kernels run on this CPU (``q4_kernels``) and the
    inputs are a multiple of 64: torch's int4 kernel turns each weight into a float and was
    the larger half of a decode step (4.1-4.4 ms for SmolLM2-135M's 30 layers against 2.3-2.7
    here, one row, Intel Xeon with AMX, 2 threads). Its results, like the int8 product's,
    are the same bits for a row in any batch. Other matrices (act-order, GPTQ or AWQ groups
    other than 32, scales beyond float16) stay Int4Linear."""

    kernels: Any  # laya_torch_kernels (q4_kernels)
    in_features: int

    @classmethod
    def of(cls, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Int8Linear:
        kernels = q4_kernels() if device.type == "cpu" else None
        out_features, in_features = weight.shape
        if kernels is None or in_features % 64:
            return Int4Linear.of(weight, bias, dtype, device)
        if isinstance(weight, GroupQuant):
            if weight.bits != 4 or weight.group_size != INT4_GROUP \
                    or weight.grouped_inputs() is not None:
                return Int4Linear.of(weight, bias, dtype, device)
            q = weight.q
            scale = weight.scales.T.to(torch.float32)  # [out, groups]
            low = -scale * weight.zeros.T.to(torch.float32)
        else:
            w = weight.to(dtype=torch.float32).view(out_features, -1, INT4_GROUP)
            low, high = w.amin(dim=2), w.amax(dim=2)
            scale = ((high - low) / 15).clamp(min=1e-12)
            q = None
        if not bool((scale.abs().amax() <= _HALF_MAX) & (low.abs().amax() <= _HALF_MAX)):
            return Int4Linear.of(weight, bias, dtype, device)
        scale, low = scale.to(torch.float16), low.to(torch.float16)
        if q is None:  # against the float16 scale and minimum the kernel will use
            q = torch.round((w - low.float()[..., None]) / scale.float()[..., None]
                            .clamp(min=1e-12)).clamp(0, 15).view(out_features, in_features)
        order = cls.order(kernels, in_features)
        values = q.to(torch.uint8)[:, order].view(out_features, -1, 2, 32)
        packed = values[:, :, 0] | (values[:, :, 1] << 4)  # [out, in / 64, 32]
        rows = torch.cat((packed.reshape(out_features, -1), scale.contiguous().view(torch.uint8),
                          low.contiguous().view(torch.uint8)), dim=1)
        assert rows.shape[1] == kernels.q4_row_bytes(in_features)
        linear = cls(rows.to(device).contiguous(),
                     None if bias is None else dense(bias, dtype, device),
                     torch.empty(0, dtype=torch.bfloat16), dtype)
        linear.kernels, linear.in_features = kernels, in_features
        return linear

    @staticmethod
    def order(kernels: Any, in_features: int) -> torch.Tensor:
        """The input of each stored 4-bit value of a row, in storing order."""
        order = torch.empty(in_features, dtype=torch.int32)
        kernels.q4_order(in_features, order.data_ptr())
        return order.long()

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.weight.shape[0], dtype=torch.bfloat16)
        self.kernels.q4_product(x.data_ptr(), x.shape[0], self.in_features,
                                self.weight.data_ptr(), self.weight.shape[0], out.data_ptr(),
                                self.threads)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a 4-bit matrix is not an embedding (the model keeps its "
                                  "embedding in int8)")

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix [out, in] these 4-bit values stand for (for tests)."""
        n, k = self.weight.shape[0], self.in_features
        groups = k // INT4_GROUP
        packed = self.weight[:, :k // 2].view(n, -1, 32)
        stored = torch.stack((packed & 15, packed >> 4), dim=2).view(n, k)
        q = torch.empty_like(stored)
        q[:, self.order(self.kernels, k)] = stored
        halves = self.weight[:, k // 2:].contiguous().view(torch.float16).float()
        scale, low = halves[:, :groups], halves[:, groups:]
        return (q.float().view(n, groups, -1) * scale[..., None] + low[..., None]).view(n, k)


def linear_kind(quantize: str) -> type[Linear]:
    """The matrix kind of a layer's projections for ``quantize``: int4 in the kernels'
    layout where they run here (``Q4Linear.of`` falls back to Int4Linear elsewhere)."""
    return {"none": Linear, "int8": Int8Linear, "int4": Q4Linear}[quantize]
