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
"""

from __future__ import annotations

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


def linear_kind(quantize: str) -> type[Linear]:
    """The matrix kind of a layer's projections for ``quantize``."""
    return {"none": Linear, "int8": Int8Linear, "int4": Int4Linear}[quantize]
