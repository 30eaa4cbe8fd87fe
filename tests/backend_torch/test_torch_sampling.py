"""The torch backend's batched sampler means what the llama.cpp backend's chain means.

References: straightforward float64 numpy versions of llama.cpp's rules, the llama.cpp
backend's own ``logprobs_of``, and llama.cpp's sampler chain itself (``build_chain``, applied
through the low-level API to the same logits).
"""

from __future__ import annotations

import ctypes
import math

import llama_cpp as ll
import numpy as np
import pytest
import torch
from laya_backend_llamacpp.sampling import build_chain, logprobs_of
from laya_backend_torch.sampling import (
    SequenceSampler,
    adjusted_logits,
    filtered_logits,
    ranked_ids,
    sample_rows,
)

from laya_core.engine.allowed_tokens import NO_TOKEN_ALLOWED, AllowedTokens
from laya_core.types import Sample, SamplingParams

CPU = torch.device("cpu")


def sampler(vocab: int = 1000, **params: object) -> SequenceSampler:
    """A sampler over ``vocab`` tokens; greedy unless ``temperature`` is given."""
    params.setdefault("temperature", 0.0)
    return SequenceSampler(SamplingParams(**params), vocab, CPU)  # type: ignore[arg-type]


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    return torch.from_numpy((gen.standard_normal((rows, vocab)) * scale).astype(np.float32))


def tokens(picks: list[Sample | str]) -> list[int]:
    return [p.token_id for p in picks]  # type: ignore[union-attr]


def reference_kept(x: np.ndarray, p: SamplingParams) -> set[int]:
    """llama.cpp's top-k -> top-p -> min-p on adjusted logits ``x`` [vocab], in float64."""
    order = np.lexsort((np.arange(len(x)), -x.astype(np.float64)))
    keep = order[:p.top_k] if p.top_k > 0 else order
    if p.top_p < 1.0:
        e = np.exp(x[keep].astype(np.float64) - x[keep[0]])
        reached = np.cumsum(e / e.sum()) >= p.top_p
        keep = keep[:int(np.argmax(reached)) + 1] if reached.any() else keep
    if p.min_p > 0.0:
        keep = keep[x[keep] >= x[keep[0]] + math.log(p.min_p)]
    return {int(t) for t in keep if x[t] > -np.inf}


def llama_apply(chain: object, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """llama.cpp's chain applied to ``row``: the candidates' ids and logits, and the pick."""
    buf = np.zeros(len(row), dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    buf["id"], buf["logit"] = np.arange(len(row)), row
    arr = ll.llama_token_data_array(buf.ctypes.data_as(ll.llama_token_data_p), len(row), -1,
                                    False)
    ll.llama_sampler_apply(chain, ctypes.byref(arr))
    out = np.ctypeslib.as_array(arr.data, shape=(arr.size,))
    return out["id"].copy(), out["logit"].copy(), int(arr.selected)


def llama_truncation(p: SamplingParams) -> object:
    """The truncating part of build_chain's chain (no temperature, no draw)."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    if p.top_k > 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(p.min_p, 1))
    return chain


TRUNCATIONS = [
    SamplingParams(top_k=40), SamplingParams(top_k=1), SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, top_k=100), SamplingParams(min_p=0.05),
    SamplingParams(top_k=50, top_p=0.8, min_p=0.1), SamplingParams(top_p=0.99, min_p=0.02),
    SamplingParams(top_k=5000), SamplingParams(top_p=0.95),
]


def test_greedy_is_the_first_of_equal_maxima() -> None:
    x = random_logits(4, 1000)
    x[0, [7, 3, 900]] = 50.0
    x[2, [999, 500]] = 50.0
    plain = [sampler() for _ in range(4)]
    assert tokens(sample_rows(x, plain, [None] * 4)) == [3, *x[1:2].argmax(-1).tolist(), 500,
                                                         int(x[3].argmax())]
    # The general path (a mask allowing both maxima, a penalized sampler) agrees.
    mask = AllowedTokens.of([3, 7, 10], 1000)
    mixed = [sampler(repetition_penalty=1.2), sampler(), sampler(), sampler()]
    assert tokens(sample_rows(x, mixed, [mask, None, None, None]))[0] == 3
    assert tokens(sample_rows(x, mixed, [None] * 4)) == tokens(sample_rows(x, plain, [None] * 4))


def test_logprobs_are_the_raw_distribution_in_float64() -> None:
    x = random_logits(4, 1000, seed=1)
    samplers = [sampler(logprobs=5, repetition_penalty=1.5, presence_penalty=1.0),
                sampler(temperature=0.8, top_k=3, logprobs=3, seed=2),
                sampler(logprobs=0), sampler(logprobs=None)]
    for t in x[0].topk(3).indices.tolist():
        samplers[0].accept(t)
    mask = AllowedTokens.of(range(0, 1000, 7), 1000)
    picks = sample_rows(x, samplers, [mask, None, None, None])
    for row, pick in enumerate(picks[:3]):
        assert isinstance(pick, Sample)
        want = logprobs_of(x[row].numpy(), pick.token_id, samplers[row].params.logprobs or 0)
        assert pick.logprob == pytest.approx(want.logprob, abs=1e-9)
        assert [t for t, _ in pick.top] == [t for t, _ in want.top]
        assert [v for _, v in pick.top] == pytest.approx([v for _, v in want.top], abs=1e-9)
    assert picks[0].top[0][0] == int(x[0].argmax())  # type: ignore[union-attr]
    assert picks[0].token_id % 7 == 0  # type: ignore[union-attr]  # masked, penalized pick
    assert picks[2].top == () and picks[3] == Sample(picks[3].token_id)  # type: ignore


def test_logprob_ties_rank_by_lower_id() -> None:
    x = torch.zeros(1, 64)
    x[0, [40, 9, 30, 2]] = 3.0
    pick = sample_rows(x, [sampler(64, logprobs=3)], [None])[0]
    assert pick.token_id == 2 and [t for t, _ in pick.top] == [2, 9, 30]  # type: ignore


def test_seeded_draws_repeat_whatever_runs_beside_them() -> None:
    def run(position: int, others: list[SequenceSampler], steps: int = 12) -> list[int]:
        mine = [sampler(2000, temperature=1.0, top_p=0.95, seed=123),
                sampler(2000, temperature=0.7, seed=5)]
        batch = others[:position] + mine + others[position:]
        out = []
        for step in range(steps):
            x = random_logits(len(batch), 2000, seed=step, scale=0.5)
            x[position:position + 2] = random_logits(2, 2000, seed=100 + step, scale=0.5)
            masks = [AllowedTokens.of(range(500), 2000) if s.params.top_k == 7 else None
                     for s in batch]
            picks = tokens(sample_rows(x, batch, masks))
            for s, t in zip(batch, picks, strict=True):
                s.accept(t)
            out += picks[position:position + 2]
        return out

    alone = run(0, [])
    crowd = [sampler(2000), sampler(2000, temperature=1.0, top_k=1500, seed=9),
             sampler(2000, temperature=0.5, top_k=7, presence_penalty=0.5),
             sampler(2000, temperature=1.2, min_p=0.1)]
    assert run(2, crowd) == alone
    assert run(4, crowd[::-1]) == alone
    assert len(set(alone)) > 12  # the draws do vary
    a, b = sampler(seed=1), sampler(seed=2)
    assert [a.uniform() for _ in range(4)] != [b.uniform() for _ in range(4)]
    c, d = sampler(), sampler()
    assert [c.uniform() for _ in range(4)] != [d.uniform() for _ in range(4)]


@pytest.mark.parametrize("params", TRUNCATIONS, ids=repr)
def test_truncation_keeps_what_llama_cpp_keeps(params: SamplingParams) -> None:
    # Peaked to flat (top-p past 256 and 4,096 candidates), then ties as bf16 logits have.
    for seed, scale, step in ((0, 3.0, 0.0), (1, 1.0, 0.0), (2, 0.3, 0.0), (3, 2.0, 0.25)):
        x = random_logits(3, 5000, seed=seed, scale=scale)
        if step:
            x = torch.round(x / step) * step
        x[1, ::3] = -math.inf  # a mask: truncations count the allowed tokens only
        kept = filtered_logits(x, [params] * 3) > -math.inf
        for row in range(3):
            ours = set(torch.nonzero(kept[row]).flatten().tolist())
            assert ours == reference_kept(x[row].numpy(), params)
            # llama.cpp keeps masked candidates at p = 0 where k > allowed, and keeps
            # whichever tied tokens its sort leaves at a cut.
            if row != 1 and not step:
                chain = llama_truncation(params)
                ids, _, _ = llama_apply(chain, x[row].numpy())
                ll.llama_sampler_free(chain)
                assert ours == set(ids.tolist())


def test_ranking_breaks_ties_by_lower_id() -> None:
    x = torch.zeros(2, 100)
    x[:, [5, 50, 7, 90, 3]] = 1.0
    x[:, 20] = 2.0
    x[1, 95:] = -math.inf
    assert ranked_ids(x, 6).tolist() == [[20, 3, 5, 7, 50, 90]] * 2  # ties inside the cut
    assert ranked_ids(x, 3).tolist() == [[20, 3, 5]] * 2  # a tie across it
    assert ranked_ids(x, 8)[:, :8].tolist() == [[20, 3, 5, 7, 50, 90, 0, 1]] * 2
    assert ranked_ids(x, 100)[0, :8].tolist() == [20, 3, 5, 7, 50, 90, 0, 1]


def test_tied_logits_draw_alike_whatever_the_batch() -> None:
    x = torch.round(random_logits(1, 5000, seed=9, scale=2.0) * 4) / 4
    def draws(batch_top_k: int | None) -> list[int]:
        mine = sampler(5000, temperature=1.0, top_k=60, top_p=0.9, seed=11)
        others = [] if batch_top_k is None else [
            sampler(5000, temperature=1.0, top_k=batch_top_k, seed=1)]
        rows = torch.cat([x, random_logits(len(others), 5000)]) if others else x
        return [tokens(sample_rows(rows, [mine, *others], [None] * len(rows)))[0]
                for _ in range(30)]
    alone = draws(None)
    assert draws(3000) == alone and draws(700) == alone
    assert len(set(alone)) > 5


def test_draws_follow_the_truncated_tempered_distribution() -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.0, -1.0, -3.0, 1.2])
    params = dict(temperature=0.7, top_p=0.8, top_k=6)
    samplers = [sampler(8, seed=i, **params) for i in range(4000)]  # type: ignore[arg-type]
    picks = np.array(tokens(sample_rows(row.expand(4000, 8), samplers, [None] * 4000)))
    kept = sorted(reference_kept(row.numpy(), samplers[0].params))
    assert set(picks.tolist()) == set(kept)
    expected = torch.softmax(row[kept] / 0.7, -1).numpy()
    freq = np.array([(picks == t).mean() for t in kept])
    assert np.abs(freq - expected).max() < 0.03


def test_penalties_follow_llama_cpps_formulas() -> None:
    s = sampler(6, max_tokens=4, repetition_penalty=1.5, frequency_penalty=0.25,
                presence_penalty=0.5)
    for t in (5, 0, 0, 1, 3):  # the window is max_tokens long: the first 5 drops out
        s.accept(t)
    x = torch.tensor([[2.0, -1.0, 0.5, -0.25, 3.0, 4.0]])
    got = adjusted_logits(x, [s], [None])[0]
    f = np.float32
    want = [f(2.0) / f(1.5) - (f(2) * f(0.25) + f(0.5)), f(-1.0) * f(1.5) - f(0.75), f(0.5),
            f(-0.25) * f(1.5) - f(0.75), f(3.0), f(4.0)]
    assert got.tolist() == [float(w) for w in want]
    # llama.cpp's own penalties sampler after the same 300 tokens, windows 16 and 400.
    x = random_logits(1, 1000, seed=3)
    history = np.random.default_rng(4).integers(0, 1000, 300).tolist()
    for window in (16, 400):
        s = sampler(max_tokens=window, repetition_penalty=1.3, frequency_penalty=0.4,
                    presence_penalty=-0.2)
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
            1000, window, 1.3, 0.4, -0.2))
        for t in history:
            s.accept(t)
            ll.llama_sampler_accept(chain, t)
        _, want_logits, _ = llama_apply(chain, x[0].numpy())
        ll.llama_sampler_free(chain)
        assert adjusted_logits(x, [s], [None])[0].tolist() == want_logits.tolist()
    # Greedy with penalties: the same tokens as the llama.cpp backend's chain, step by step.
    chain = build_chain(ll, s.params, 1000)
    for t in history:
        ll.llama_sampler_accept(chain, t)
    for step in range(20):
        row = random_logits(1, 1000, seed=50 + step, scale=0.3)
        row[0, history[-5:]] += 1.0  # tempt it to repeat
        _, _, selected = llama_apply(chain, row[0].numpy())
        ours = tokens(sample_rows(row, [s], [None]))[0]
        assert ours == selected
        s.accept(ours)
        ll.llama_sampler_accept(chain, ours)
    ll.llama_sampler_free(chain)


def test_same_token_as_llama_cpp_where_the_draw_has_one_choice() -> None:
    x = random_logits(3, 1000, seed=6)
    x[2, 17] = 30.0  # peaked: top-p 0.5 keeps one token
    cases = [SamplingParams(temperature=0.7, top_k=1, seed=1),
             SamplingParams(temperature=1.3, top_k=1, top_p=0.9, seed=2),
             SamplingParams(temperature=1.0, top_p=0.5, seed=3)]
    ours = tokens(sample_rows(x, [SequenceSampler(p, 1000, CPU) for p in cases], [None] * 3))
    for row, p in enumerate(cases):
        chain = build_chain(ll, p, 1000)
        ids, _, selected = llama_apply(chain, x[row].numpy())
        ll.llama_sampler_free(chain)
        assert ours[row] == int(ids[selected])
    assert ours[2] == 17


class EdgeSampler(SequenceSampler):
    """A sampler whose uniforms are fixed, to try the ends of [0, 1)."""

    def __init__(self, u: float, **params: object) -> None:
        super().__init__(SamplingParams(**params), 8, CPU)  # type: ignore[arg-type]
        self.u = u

    def uniform(self) -> float:
        return self.u


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0 ** -53])
def test_a_masked_token_is_never_drawn_even_at_the_ends(u: float) -> None:
    x = torch.tensor([[9.0, 1.0, 0.0, 2.0, 0.5, -1.0, 8.0, 3.0]]).expand(3, 8)
    mask = AllowedTokens.of([2, 3, 4], 8)
    samplers = [EdgeSampler(u, temperature=1.0), EdgeSampler(u, temperature=1.0, top_k=6),
                EdgeSampler(u, temperature=1.0, top_p=0.999)]
    for pick in tokens(sample_rows(x, samplers, [mask] * 3)):
        assert pick in {2, 3, 4}


def test_masks_limit_every_kind_of_pick() -> None:
    x = random_logits(4, 1000, seed=7)
    x[:, 0] = 40.0
    allowed = [11, 22, 33, 44, 55]
    mask = AllowedTokens.of(allowed, 1000)
    best = sorted(allowed, key=lambda t: -float(x[1, t]))
    samplers = [sampler(), sampler(temperature=1.0, top_k=2, seed=1),
                sampler(temperature=2.0, seed=2), sampler(temperature=1.0, top_p=0.7, seed=3)]
    for _ in range(50):
        picks = tokens(sample_rows(x, samplers, [mask] * 4))
        assert picks[0] == max(allowed, key=lambda t: float(x[0, t]))
        assert picks[1] in best[:2]  # top-k counts allowed tokens only
        assert set(picks[2:]) <= set(allowed)


def test_a_mask_allowing_nothing_fails_its_row_alone() -> None:
    x = random_logits(3, 1000, seed=8)
    nothing = AllowedTokens.of([], 1000)
    picks = sample_rows(x, [sampler(logprobs=2), sampler(temperature=1.0, seed=1),
                            sampler(logprobs=1)], [None, nothing, None])
    assert picks[1] == NO_TOKEN_ALLOWED
    assert isinstance(picks[0], Sample) and picks[0].token_id == int(x[0].argmax())
    assert isinstance(picks[2], Sample) and len(picks[2].top) == 1
    assert sample_rows(x[:1], [sampler()], [nothing]) == [NO_TOKEN_ALLOWED]


def test_a_mask_over_another_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot mask logits over 1000"):
        sample_rows(random_logits(1, 1000), [sampler()], [AllowedTokens.of([1], 999)])
