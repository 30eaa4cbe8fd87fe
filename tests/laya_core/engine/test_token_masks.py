"""Allowed-token masks: the bitmask itself, and the engine carrying a sequence's constraint
to the backend (the toy backend, whose masked choice is the lowest allowed token)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from toy_backend import END, started_engine

from laya_core.engine.allowed_tokens import NO_TOKEN_ALLOWED, AllowedTokens, TokenConstraint
from laya_core.engine.engine import Engine
from laya_core.types import FinishReason, SamplingParams, TokenEvent

VOCAB = 49152


def test_a_mask_allows_exactly_its_tokens() -> None:
    ids = [0, 5, 31, 32, 1000, VOCAB - 1]
    mask = AllowedTokens.of(ids, VOCAB)
    assert mask.words.dtype == np.uint32 and mask.words.shape == (VOCAB // 32,)
    assert mask.token_ids().tolist() == ids
    assert [t for t in range(VOCAB) if mask.allows(t)] == ids
    assert not mask.allows(-1) and not mask.allows(VOCAB)
    assert not mask.is_empty() and AllowedTokens.of([], VOCAB).is_empty()
    assert mask.to_bools().sum() == len(ids)


def test_bits_past_the_vocabulary_are_ignored() -> None:
    words = np.zeros(1, np.uint32)
    words[0] = 1 << 5  # token 5 of a 3-token vocabulary
    mask = AllowedTokens(3, words)
    assert mask.is_empty() and mask.token_ids().size == 0 and not mask.allows(5)


def test_a_grammar_engines_int32_bitmask_is_used_without_a_copy() -> None:
    filled = np.zeros(VOCAB // 32, np.int32)  # as llguidance fills it
    filled[1] = -1  # tokens 32 .. 63, the sign bit included
    mask = AllowedTokens.from_bitmask(filled, VOCAB)
    assert np.shares_memory(mask.words, filled)
    assert mask.token_ids().tolist() == list(range(32, 64))


def test_a_mask_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="1536 uint32 words"):
        AllowedTokens(VOCAB, np.zeros(10, np.uint32))
    with pytest.raises(ValueError, match="0 .. 9"):
        AllowedTokens.of([10], 10)
    with pytest.raises(ValueError, match="cannot mask logits"):
        AllowedTokens.of([1], 10).mask_logits(np.zeros(11, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [1, 12, VOCAB // 2, VOCAB - 1])
def test_masking_sets_exactly_the_disallowed_logits_to_minus_infinity(
        dtype: type, count: int) -> None:
    rng = np.random.default_rng(count)
    logits = rng.standard_normal(VOCAB).astype(dtype)
    logits[7] = -np.inf  # already -inf, allowed or not, stays so
    before = logits.copy()
    allowed = rng.choice(VOCAB, count, replace=False)
    mask = AllowedTokens.of(allowed.tolist(), VOCAB)
    mask.mask_logits(logits)
    keep = mask.to_bools()
    assert np.array_equal(logits[keep], before[keep])
    assert np.all(np.isneginf(logits[~keep]))


# The toy engine: the model repeats its prompt; under a mask it says the lowest allowed token.

def run(engine: Engine, prompt: bytes, params: SamplingParams,
        constraint: TokenConstraint | None) -> list[TokenEvent]:
    async def go() -> list[TokenEvent]:
        stream = engine.submit(list(prompt), params, constraint=constraint)
        return [e async for e in stream]

    return asyncio.run(go())


def allowing(text: bytes, *extra: int) -> AllowedTokens:
    return AllowedTokens.of([*text, *extra], 257)


def test_the_engine_asks_the_constraint_before_each_sampled_token() -> None:
    e = started_engine(max_seq_len=64, max_step_tokens=4)
    seen: list[list[int]] = []

    def constraint(output: Sequence[int]) -> AllowedTokens:
        seen.append(list(output))
        return allowing(b"ac")

    events = run(e, b"abcdefg", SamplingParams(max_tokens=6, logprobs=0), constraint)
    # The model says a b c d e f; each token it would say outside {a, c} becomes "a".
    assert "".join(ev.text for ev in events) == "aacaaa"
    assert seen == [list(b"aacaaa"[:n]) for n in range(6)]
    assert [s.logprob for ev in events for s in ev.samples] == [0.0, -np.inf, 0.0] + [-np.inf] * 3
    items = [item for step in e.backend.steps for item in step]  # type: ignore[attr-defined]
    assert all(item.allowed_tokens is None for item in items if not item.sample)
    assert all(item.allowed_tokens is not None for item in items if item.sample)
    e.stop()


def test_a_mask_without_the_end_token_means_the_sequence_cannot_stop_there() -> None:
    e = started_engine(max_seq_len=64)
    prompt = b"ab\0"  # the model says a, b, then the end token
    free = run(e, prompt, SamplingParams(max_tokens=8), lambda out: allowing(b"ab", END))
    assert free[-1].finish_reason is FinishReason.STOP
    held = run(e, prompt, SamplingParams(max_tokens=8), lambda out: allowing(b"ab"))
    assert held[-1].finish_reason is FinishReason.LENGTH
    assert "".join(ev.text for ev in held) == "abaabaab"
    e.stop()


def test_a_mask_allowing_nothing_ends_that_sequence_alone_as_cut_short() -> None:
    """A constraint that cannot go on (a step past its matcher's limits) ends its sequence
    the way max_tokens does: what was generated is a beginning of a match, "length"."""
    e = started_engine(max_seq_len=64, max_num_seqs=2)

    def dies_at_the_third(output: Sequence[int]) -> AllowedTokens | None:
        return AllowedTokens.of([], 257) if len(output) == 2 else None

    async def go() -> tuple[list[TokenEvent], list[TokenEvent]]:
        doomed = e.submit(list(b"xyz"), SamplingParams(max_tokens=10),
                          constraint=dies_at_the_third)
        other = e.submit(list(b"pq"), SamplingParams(max_tokens=10))
        return ([ev async for ev in doomed], [ev async for ev in other])

    doomed, other = asyncio.run(go())
    assert doomed[-1].finish_reason is FinishReason.LENGTH
    assert doomed[-1].error == NO_TOKEN_ALLOWED
    assert "".join(ev.text for ev in doomed) == "xy"
    assert other[-1].finish_reason is FinishReason.LENGTH
    assert "".join(ev.text for ev in other) == "pqpqpqpqpq"
    assert e.num_running == 0 and e.kv_usage == 0.0
    e.stop()
