"""The 4-bit layer products of laya_torch_kernels (src/q4.cpp) and their matrices
(quant.Q4Linear): against exact products of what the matrix holds, within bfloat16's
rounding, on both the AVX-512 and the AVX2 code (this CPU runs whichever it has; the AVX2
code runs on every CPU CI uses); a row's result the same bits alone, in a batch and on any
thread count; a Q4_1 file's weights kept exactly; the kept threads (src/pool.cpp) safe
across a fork and beside a second caller."""

from __future__ import annotations

import multiprocessing
import threading

import laya_torch_kernels as kernels
import pytest
import torch
from laya_backend_torch.checkpoint import open_checkpoint
from laya_backend_torch.packed import GroupQuant
from laya_backend_torch.quant import Int4Linear, Q4Linear

from laya_core.builtin.model_paths import embedded_file

CPU = torch.device("cpu")
BF16 = torch.bfloat16
PATHS = [False, True] if kernels.q4_path() == "avx512-vnni" else [True]


def product(linear: Q4Linear, x: torch.Tensor, threads: int, avx2: bool) -> torch.Tensor:
    out = torch.empty(x.shape[0], linear.weight.shape[0], dtype=BF16)
    kernels.q4_product(x.data_ptr(), x.shape[0], x.shape[1], linear.weight.data_ptr(),
                       linear.weight.shape[0], out.data_ptr(), threads, avx2)
    return out


def matrix(out_features: int, in_features: int, seed: int = 0) -> Q4Linear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    linear = Q4Linear.of(weight * 0.05, None, BF16, CPU)
    assert type(linear) is Q4Linear
    return linear


def test_the_cpu_runs_the_4_bit_products() -> None:
    """Both kinds of CPU CI runs on have AVX2 (and the Xeon AVX512-VNNI): the model's int4
    layers are Q4Linear there, never silently torch's."""
    assert kernels.q4_path() in ("avx512-vnni", "avx2")


@pytest.mark.parametrize("avx2", PATHS)
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(3072, 576), (576, 1536), (7, 896), (33, 64), (9, 128), (5, 192)])
def test_products_are_exact_sums_rounded_once(avx2: bool, out_features: int,
                                              in_features: int) -> None:
    """Against float64 products of the matrix it holds: within x's 16-bit steps and one
    bfloat16 rounding. Inputs of 64 to 1536 make a row's pieces of 16, 8, 4 and 2 groups;
    outputs that are no multiple of four end in a narrower tile."""
    linear = matrix(out_features, in_features)
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(1)).to(BF16)
    x[3, 5] = 40.0  # one group with a large value beside small ones
    x[4] = x[4] * 2.0 ** 100  # far beyond 16 bits of range: the steps follow the group
    exact = x.double() @ linear.dequantized().double().T
    got = product(linear, x, 2, avx2).double()
    tolerance = 2.0 ** -8 * exact.abs() + 2.0 ** -12 * exact.abs().amax(dim=1, keepdim=True)
    assert ((got - exact).abs() <= tolerance).all(), (got - exact).abs().max()
    assert (got == exact.to(BF16).double()).float().mean() > 0.95  # mostly the exact rounding


@pytest.mark.parametrize("avx2", PATHS)
def test_a_row_gets_the_same_bits_in_any_batch_and_on_any_thread(avx2: bool) -> None:
    linear = matrix(832, 576, seed=2)
    x = torch.randn(67, 576, generator=torch.Generator().manual_seed(3)).to(BF16)
    together = product(linear, x, 2, avx2)
    assert torch.equal(product(linear, x, 1, avx2), together)
    for r in (0, 1, 33, 66):
        assert torch.equal(product(linear, x[r:r + 1].clone(), 2, avx2)[0], together[r])
    assert torch.equal(product(linear, x[5:9].clone(), 1, avx2), together[5:9])


@pytest.mark.parametrize("avx2", PATHS)
def test_zeros_nan_and_infinity(avx2: bool) -> None:
    """A row of zeros gives zeros (no division by a zero step); a NaN or an infinity in a
    row makes that row's outputs NaN, as floats would, and leaves the others alone."""
    linear = matrix(64, 576, seed=4)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5)).to(BF16)
    x[1] = 0.0
    clean = product(linear, x, 1, avx2)
    assert torch.equal(clean[1], torch.zeros(64, dtype=BF16))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 100] = bad
        got = product(linear, y, 1, avx2)
        assert got[2].isnan().all() and torch.equal(got[:2], clean[:2])


def test_a_q4_1_files_weights_are_kept_exactly() -> None:
    """The file stores each block's scale and minimum in float16, as Q4Linear keeps them:
    the matrix holds the file's weights to the bit, read as stored (GroupQuant) or from the
    dequantized floats."""
    checkpoint = open_checkpoint(embedded_file("smollm2-135m-instruct"))
    wanted = ("model.layers.0.self_attn.k_proj.weight", "model.layers.5.mlp.down_proj.weight")
    dense = dict(t for t in checkpoint.tensors() if t[0] in wanted)
    stored = dict(t for t in checkpoint.tensors(as_stored=True) if t[0] in wanted)
    for name in wanted:
        assert isinstance(stored[name], GroupQuant)
        for weight in (stored[name], dense[name]):
            linear = Q4Linear.of(weight, None, BF16, CPU)
            assert type(linear) is Q4Linear
            assert torch.equal(linear.dequantized(), dense[name]), name
            assert linear.nbytes == weight.shape[0] * weight.shape[1] * 5 // 8


def test_matrices_the_layout_cannot_take_stay_on_torchs_kernel() -> None:
    """Inputs that are no multiple of 64, GPTQ groups of 128 and scales beyond float16 keep
    torch's int4 layout (or int8), as before."""
    narrow = torch.randn(64, 96) * 0.05
    assert type(Q4Linear.of(narrow, None, BF16, CPU)) is not Q4Linear
    q = torch.randint(0, 16, (64, 256), dtype=torch.int32)
    grouped = GroupQuant(q, torch.rand(2, 64) * 0.01 + 1e-3, torch.full((2, 64), 8.0),
                         torch.arange(256) // 128, 128, 4)
    assert type(Q4Linear.of(grouped, None, BF16, CPU)) is Int4Linear
    assert type(Q4Linear.of(torch.randn(64, 128) * 1e6, None, BF16, CPU)) is not Q4Linear
    by32 = GroupQuant(q, torch.rand(8, 64) * 0.01 + 1e-3, torch.randint(0, 16, (8, 64)).float(),
                      torch.arange(256) // 32, 32, 4)
    linear = Q4Linear.of(by32, None, BF16, CPU)
    assert type(linear) is Q4Linear
    assert torch.allclose(linear.dequantized(), by32.dequantize(), atol=1e-4, rtol=1e-3)


def _in_a_child(linear: Q4Linear, x: torch.Tensor, queue: multiprocessing.Queue) -> None:
    # Only the kernel and an empty tensor here: PyTorch's own OpenMP threads are not safe
    # to use in a fork's child once the parent used them.
    queue.put(product(linear, x, 2, False).view(torch.int16).numpy().tobytes())


def test_a_forked_child_starts_its_own_workers() -> None:
    """The parent's workers do not exist in a fork's child: its products neither wait for
    them nor go wrong (the caller claims every task the workers it starts do not)."""
    linear = matrix(3072, 576, seed=6)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(7)).to(BF16)
    want = product(linear, x, 2, False)  # the parent's workers are started
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_a_child, args=(linear, x, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == want.view(torch.int16).numpy().tobytes()


def test_two_callers_at_once_each_get_their_own_products() -> None:
    """The kept threads take one call at a time; a second caller meanwhile computes its
    product alone, and both are right."""
    linears = [matrix(3072, 576, seed=s) for s in (8, 9)]
    xs = [torch.randn(3, 576, generator=torch.Generator().manual_seed(s)).to(BF16)
          for s in (10, 11)]
    for linear in linears:
        linear.threads = 2
    want = [linear(x) for linear, x in zip(linears, xs, strict=True)]
    wrong: list[int] = []

    def calls(k: int) -> None:
        for _ in range(200):
            if not torch.equal(linears[k](xs[k]), want[k]):
                wrong.append(k)

    callers = [threading.Thread(target=calls, args=(k,)) for k in (0, 1)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=300)
    assert not any(caller.is_alive() for caller in callers) and not wrong


def test_the_backend_multiplies_its_int4_layers_here() -> None:
    """The embedded model's int4 layers are Q4Linear (/ready's ``int4_products`` names the
    code), every product of a decode step is in the kernels, and a decode step hands
    PyTorch's own threads back as it found them."""
    from laya_backend_torch.backend import TorchBackend

    from laya_core.backend import ModelConfig, StepItem
    from laya_core.types import SamplingParams

    before = torch.get_num_threads()
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=256, max_num_seqs=1, options={"n_threads": 2}))
    backend.load_weights()
    backend.allocate_kv(num_tokens=16 * 16, max_num_seqs=1)
    try:
        assert backend.describe()["int4_products"] == f"laya_torch_kernels ({kernels.q4_path()})"
        model = backend._model  # type: ignore[attr-defined]
        assert model.products_native is kernels.head_supported()
        assert all(m.threads == 2 for m in model._layer_matrices())
        backend.start_sequence(0, SamplingParams(max_tokens=4, temperature=0.0))
        (first,) = backend.step([StepItem(0, list(range(200, 230)), 0, True,
                                          block_table=[0, 1])])
        assert first.sample is not None and torch.get_num_threads() == 2
        (second,) = backend.step([StepItem(0, [first.sample.token_id], 30, True,
                                           block_table=[0, 1])])
        assert second.sample is not None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
