"""Prompt log-probabilities in the core: chunking within the scored-rows budget, no prefix
reuse for a scored prompt, what the backend is asked, and what the engine hands back."""

from __future__ import annotations

import asyncio

import pytest
from toy_backend import ToyBackend, started_engine

from laya_core.backend import ModelConfig
from laya_core.engine.engine import Engine
from laya_core.engine.request import Request
from laya_core.engine.scheduler import FcfsScheduler, SchedulerConfig
from laya_core.kv.policies import PagedKVCache
from laya_core.memory.ledger import MAX_SCORED_TOKENS_PER_STEP, scored_tokens_per_step
from laya_core.types import SamplingParams, TokenEvent

_ids = iter(range(10**6))


def seq(prompt_len: int, scored: bool, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens, prompt_logprobs=2 if scored else None)
    return Request(next(_ids), list(range(1, prompt_len + 1)), params)


def run_prefill(s: FcfsScheduler) -> list[list[tuple[Request, int, int]]]:
    """Schedule until nothing prefills; each step's (sequence, tokens, scored targets)."""
    steps = []
    while any(x.is_prefilling for x in s.running) or s.waiting:
        chunks = s.schedule().chunks
        steps.append([(c.seq, len(c.tokens), len(c.item().score_targets)) for c in chunks
                      if c.seq.is_prefilling])
        for c in chunks:
            c.seq.num_computed += len(c.tokens)
            if c.samples:
                c.seq.output_token_ids.append(7)
    return steps


def test_the_scored_rows_of_a_step_stay_within_their_budget() -> None:
    s = FcfsScheduler(SchedulerConfig(4, 512, max_scored_tokens=128),
                      PagedKVCache(4096, 4, prefix_caching=False))
    a, b, plain = seq(300, True), seq(100, True), seq(300, False)
    for x in (a, b, plain):
        s.add(x)
    steps = run_prefill(s)
    assert steps[0] == [(a, 128, 128), (plain, 300, 0)]  # b waits: no scored rows left
    for step in steps:
        assert sum(n for _, _, n in step) <= 128
    fed = {x: [t for step in steps for y, t, _ in step if y is x] for x in (a, b)}
    assert fed[a] == [128, 128, 44] and sum(fed[b]) == 100
    # Each prompt token but the first is scored once; the last row samples instead.
    assert sum(n for step in steps for y, _, n in step if y is a) == 299


def test_a_scored_prompt_takes_nothing_from_the_prefix_cache() -> None:
    s = FcfsScheduler(SchedulerConfig(4, 512), PagedKVCache(4096, 4))
    first = seq(64, False)
    s.add(first)
    run_prefill(s)
    s.finish(first, retain=True)
    scored, again = (Request(next(_ids), list(first.prompt_token_ids), p)
                     for p in (SamplingParams(4, prompt_logprobs=0), SamplingParams(4)))
    s.add(scored)
    s.add(again)
    s.schedule()
    assert scored.num_cached_tokens == 0 and scored.num_computed == 0
    assert again.num_cached_tokens == 48  # others still reuse it: whole blocks, 2 left


def test_the_step_budget_bounds_the_scored_rows() -> None:
    assert scored_tokens_per_step(16) == 16
    assert scored_tokens_per_step(4096) == MAX_SCORED_TOKENS_PER_STEP


def toy_engine(**config: object) -> Engine:
    return started_engine(**{"max_seq_len": 512, **config})


def generate(e: Engine, prompt: bytes, params: SamplingParams) -> list[TokenEvent]:
    async def go() -> list[TokenEvent]:
        return [event async for event in e.submit(list(prompt), params)]

    return asyncio.run(go())


def test_the_engine_returns_each_prompt_token_scored_once_with_the_first_token() -> None:
    e = toy_engine(max_num_seqs=2)
    try:
        prompt = b"a longer prompt, to be scored in chunks. " * 8  # 328 tokens
        generate(e, prompt, SamplingParams(max_tokens=3, temperature=0))  # cached
        hits = e.prefix_hits
        events = generate(e, prompt, SamplingParams(max_tokens=3, temperature=0,
                                                    prompt_logprobs=1))
        assert e.prefix_hits == hits
        scored = [s for ev in events for s in ev.prompt_logprobs]
        assert events[0].prompt_logprobs == tuple(scored)  # all of it, with the first token
        assert [s.token_id for s in scored] == list(prompt[1:])
        assert all(s.logprob == 0.0 and s.rank == 1 for s in scored)
        items = [i for step in e.backend.steps[-6:]  # type: ignore[attr-defined]
                 for i in step if i.score_targets]
        assert [(i.start_pos, len(i.tokens), len(i.score_targets)) for i in items] \
            == [(0, 128, 128), (128, 128, 128), (256, 72, 71)]
    finally:
        e.stop()


def test_a_backend_without_prompt_logprobs_refuses_them() -> None:
    class Plain(ToyBackend):
        supports_prompt_logprobs = False

    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=64)
    e = Engine(cfg, Plain(cfg), FcfsScheduler, PagedKVCache)
    e.start()
    assert e.wait_ready(5)
    try:
        with pytest.raises(ValueError, match="cannot compute prompt log-probabilities"):
            generate(e, b"abc", SamplingParams(prompt_logprobs=0))
    finally:
        e.stop()
