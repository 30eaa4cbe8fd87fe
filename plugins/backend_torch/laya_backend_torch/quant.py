"""The model's matrices: dense in the compute dtype, or int8 per output channel.

Weight-only int8 halves bfloat16's bytes (and quarters float32's), and decoding on a CPU is
bound by reading the weights once a token. ``torch._weight_int8pack_mm`` multiplies
activations by int8 weights with one scale per output row without dequantizing the matrix;
it is fast with bfloat16 activations and slow with float32 ones (measured on an AMD EPYC
with AVX512-BF16, SmolLM2-135M decoding alone on one thread: 31 tokens/s with bfloat16
activations, 4.7 with float32), so the matrix product always runs in bfloat16, whatever the
model's compute dtype, and its result returns in that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def dense(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


class Linear:
    """``x @ weight.T + bias`` with a dense weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Linear:
        return cls(dense(weight, dtype, device),
                   None if bias is None else dense(bias, dtype, device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.weight.dtype != torch.float32:
            return F.linear(two_rows(x), self.weight, self.bias)[:1]
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
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
           device: torch.device) -> Int8Linear:
        w = weight.to(device=device, dtype=torch.float32)
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, None if bias is None else dense(bias, dtype, device),
                   scales.to(torch.bfloat16).contiguous(), dtype)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(weight, bias)
        self.scales, self.dtype = scales, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        out = torch._weight_int8pack_mm(x, self.weight, self.scales).to(self.dtype)
        return out if self.bias is None else out + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[ids].to(torch.float32)
                * self.scales[ids, None].to(torch.float32)).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.scales.nbytes
