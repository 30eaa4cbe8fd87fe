"""laya_torch_kernels (plugins/backend_torch/kernels) against PyTorch's operations: each
kernel gives what the eager operations it replaces give, within bfloat16's rounding, on
bfloat16 and float16 KV pools; attention split over threads gives the bits of one thread.
The int8 output head runs on CPUs with AVX2 (both kinds CI runs on; the Xeon's AVX512-VNNI
code and the AVX2 code are both tested there); elsewhere the model keeps torch's product,
which test_exact_drafts checks."""

from __future__ import annotations

import laya_torch_kernels as kernels
import pytest
import torch
import torch.nn.functional as F
from laya_backend_torch.rope import cos_sin_table, rotate, signed

BF16 = torch.bfloat16


def close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """Within ``ulps`` bfloat16 steps (8 bits of mantissa) of the largest magnitude in each
    row: the eager operations round after each step, the kernels once, and a sum that
    cancels (a rotation's) keeps the error of its terms."""
    tolerance = ulps * 2.0 ** -8 * want.float().abs().amax(dim=-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= tolerance).all(), \
        (got.float() - want.float()).abs().max()


def test_add_rms_norm() -> None:
    torch.manual_seed(0)
    h, delta = torch.randn(5, 576, dtype=BF16), torch.randn(5, 576, dtype=BF16)
    weight = torch.randn(576, dtype=BF16)
    out = torch.empty_like(h)
    summed = h + delta
    kernels.add_rms_norm(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                         5, 576, 1e-5)
    assert torch.equal(h, summed)  # the residual stream, updated in place
    close(out, F.rms_norm(summed.float(), (576,), weight.float(), 1e-5))
    again = torch.empty_like(h)  # without a delta: the norm alone, h untouched
    kernels.add_rms_norm(h.data_ptr(), 0, weight.data_ptr(), again.data_ptr(), 5, 576, 1e-5)
    assert torch.equal(h, summed) and torch.equal(again, out)


def test_silu_mul() -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 1536, dtype=BF16) * 4
    out = torch.empty(3, 1536, dtype=BF16)
    kernels.silu_mul(gate_up.data_ptr(), out.data_ptr(), 3, 1536)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(out, F.silu(gate) * up)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_rope_store_and_attend(pool_dtype: torch.dtype) -> None:
    """Three one-token queries over histories of 1, 40 and 300 pool slots (scattered), with
    9 query heads on 3 K/V heads, against the eager rotation and scaled_dot_product_attention."""
    torch.manual_seed(2)
    heads, kv_heads, dim = 9, 3, 64
    cos, sin = cos_sin_table(dim, 100000.0, None, 512, torch.float32)
    cos, ssin = cos.to(BF16), signed(sin).to(BF16)
    pool = torch.randn(1024, 2 * kv_heads, dim).to(pool_dtype)
    lengths = [1, 40, 300]
    histories = [torch.randperm(1024)[:n] for n in lengths]
    positions = torch.tensor([n - 1 for n in lengths])
    slots = torch.stack([h[-1] for h in histories])
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, dtype=BF16)
    eager = qkv.view(3, -1, dim)
    rotated = rotate(eager[:, :heads + kv_heads], cos[positions].unsqueeze(1),
                     ssin[positions].unsqueeze(1))
    kv = torch.cat((rotated[:, heads:], eager[:, heads + kv_heads:]), dim=1)
    half = pool_dtype == torch.float16
    kernels.rope_store(qkv.data_ptr(), 3, positions.data_ptr(), cos.data_ptr(), ssin.data_ptr(),
                       heads, kv_heads, dim, pool.data_ptr(), half, slots.data_ptr())
    close(qkv.view(3, -1, dim)[:, :heads + kv_heads], rotated)
    close(pool[slots], kv.to(pool_dtype))
    spec = torch.tensor([[r, sum(lengths[:r]), n] for r, n in enumerate(lengths)])
    flat = torch.cat(histories)
    out = torch.zeros(3, heads * dim, dtype=BF16)
    for threads in (1, 2):  # 2: above the threshold (300 keys), split over two threads
        got = torch.zeros_like(out)
        kernels.attend(qkv.data_ptr(), qkv.shape[1], pool.data_ptr(), half, spec.data_ptr(),
                       flat.data_ptr(), 3, got.data_ptr(), heads, kv_heads, dim, dim ** -0.5,
                       threads)
        if threads == 1:
            out = got
        assert torch.equal(got, out), threads
    q = qkv.view(3, -1, dim)[:, :heads].float()
    for r, history in enumerate(histories):
        k = pool[history].float().transpose(0, 1).unsqueeze(0)  # [1, 2 kv_heads, n, dim]
        want = F.scaled_dot_product_attention(q[r].view(1, heads, 1, dim), k[:, :kv_heads],
                                              k[:, kv_heads:], enable_gqa=True)
        close(out[r], want.view(-1), ulps=4)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_a_single_key_gives_its_value_exactly(pool_dtype: torch.dtype) -> None:
    """Over one key the softmax is 1, so the output is that key's V to the bit: the pool's
    elements are read exactly, float16's subnormals, largest values and signs included."""
    heads, kv_heads, dim = 9, 3, 64
    pool = torch.zeros(4, 2 * kv_heads, dim, dtype=pool_dtype)
    info = torch.finfo(pool_dtype)
    special = torch.tensor([info.tiny / 4, -info.tiny / 2, info.tiny, -info.max, info.max,
                            0.0, -0.0, 1.0], dtype=torch.float64)
    torch.manual_seed(3)
    v = torch.randn(kv_heads, dim, dtype=torch.float64)
    v[0, :len(special)] = special
    pool[2, kv_heads:] = v.to(pool_dtype)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, dtype=BF16)
    out = torch.empty(1, heads * dim, dtype=BF16)
    spec, history = torch.tensor([[0, 0, 1]]), torch.tensor([2])
    kernels.attend(qkv.data_ptr(), qkv.shape[1], pool.data_ptr(), pool_dtype == torch.float16,
                   spec.data_ptr(), history.data_ptr(), 1, out.data_ptr(), heads, kv_heads,
                   dim, dim ** -0.5, 1)
    want = pool[2, kv_heads:].float().repeat_interleave(heads // kv_heads, dim=0).to(BF16)
    assert torch.equal(out.view(heads, dim), want)


def test_the_cpu_runs_the_head() -> None:
    assert kernels.head_supported()  # AVX2: both kinds of CPU CI runs on


@pytest.mark.parametrize("avx2", [False, True], ids=["best", "avx2"])
def test_head_int8(avx2: bool) -> None:
    """Against torch's int8 product within bfloat16's rounding; and each row's logits are
    the same bits alone, beside other rows, and split over two threads. A vocabulary that is
    no multiple of four has its last outputs one at a time. The AVX2 code's logits are the
    bits of the AVX-512 code's (exact integer sums)."""

    def head(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
             threads: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0])
        kernels.head_int8(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(),
                          scales.data_ptr(), out.data_ptr(), w.shape[0], threads, avx2)
        return out

    torch.manual_seed(4)
    vocab, dim = 4099, 576
    w = torch.randint(-127, 128, (vocab, dim), dtype=torch.int8)
    w[0] = 127  # the largest sum a row can make: no 32-bit overflow
    scales = (torch.rand(vocab) * 0.01 + 1e-3).to(BF16)
    x = torch.randn(6, dim, dtype=BF16)
    x[5] = 0.0  # a row of zeros gives zeros, not a division by zero
    x[4, 0] = 1e4  # one large value beside small ones
    x[3] = x[3].abs() * 2.0 ** 100  # far beyond 16 bits of range: the steps follow the row
    together = head(x, w, scales, 2)
    close(together, torch._weight_int8pack_mm(x, w, scales).float())
    assert torch.equal(together[5], torch.zeros(vocab))
    for r in range(6):
        assert torch.equal(head(x[r:r + 1].clone(), w, scales, 1)[0], together[r])
        assert torch.equal(head(x[r:r + 1].clone(), w, scales, 2)[0], together[r])
    assert torch.equal(head(x[1:4].clone(), w, scales, 1), together[1:4])
    for bad in (float("nan"), float("inf")):  # a row with a NaN or infinity: NaN logits
        y = x[:2].clone()
        y[1, 7] = bad
        logits = head(y, w, scales, 1)
        assert logits[1].isnan().all() and torch.equal(logits[0], together[0])
    best = torch.empty_like(together)
    kernels.head_int8(x.data_ptr(), 6, dim, w.data_ptr(), scales.data_ptr(), best.data_ptr(),
                      vocab, 2)
    assert torch.equal(best, together)


def test_head_int8_with_fewer_than_64_outputs() -> None:
    """A head of fewer than 64 outputs but work enough for the kept threads: one chunk, not
    a division by zero chunks."""
    torch.manual_seed(5)
    vocab, dim = 40, 4096
    w = torch.randint(-127, 128, (vocab, dim), dtype=torch.int8)
    scales = (torch.rand(vocab) * 0.01 + 1e-3).to(BF16)
    x = torch.randn(1, dim, dtype=BF16)
    out = torch.empty(1, vocab)
    kernels.head_int8(x.data_ptr(), 1, dim, w.data_ptr(), scales.data_ptr(), out.data_ptr(),
                      vocab, 2)
    close(out, torch._weight_int8pack_mm(x, w, scales).float())
