"""The step plan on the paged KV cache: chunks, block tables, ops, and exact outputs.

``PagedToy`` is the toy model of tests/toy_backend.py (position p of a sequence answers
``prompt[p % len(prompt)]``) reading its history through block tables only: a block table
that is wrong, or KV shared where it should not be, changes its output.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from laya_core.backend import StepItem, StepResult
from laya_core.engine.request import Request, RequestStatus
from laya_core.engine.step_plan import build_plan
from laya_core.kv.policies import FreeSequence, PagedKVCache, StartSequence
from laya_core.types import Sample, SamplingParams

BS = 16


class PagedToy:
    """A paged backend: one KV pool of blocks, one token id stored per position."""

    kv_layout = "paged"

    def __init__(self, num_blocks: int) -> None:
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.prompt_len: dict[int, int] = {}
        self.started: set[int] = set()

    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        assert seq_id not in self.started
        self.started.add(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        self.started.remove(seq_id)
        self.prompt_len.pop(seq_id, None)

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        out = []
        for item in items:
            assert item.seq_id in self.started
            table = item.block_table
            for p in range(item.start_pos):  # what is there already is this sequence's
                assert self.pool[table[p // BS]][p % BS] is not None, "KV missing"
            for j, token in enumerate(item.tokens):
                p = item.start_pos + j
                self.pool[table[p // BS]][p % BS] = token
            if not item.sample:
                out.append(StepResult())
                continue
            end = item.start_pos + len(item.tokens)
            history = [self.pool[table[p // BS]][p % BS] for p in range(end)]
            n = self.prompt_len.setdefault(item.seq_id, end)
            token = history[end % n]
            assert token is not None
            out.append(StepResult(Sample(token)))
        return out


def run_all(prompts: list[list[int]], max_tokens: int, num_blocks: int = 64,
            max_seqs: int = 4, step_tokens: int = 48, prefix_caching: bool = True,
            scored: frozenset[int] = frozenset()) -> tuple[list[Request], PagedKVCache]:
    """Serve the prompts FCFS, decode before prefill, as the engine does, to the end."""
    kv = PagedKVCache(num_blocks * BS, max_seqs, prefix_caching)
    backend = PagedToy(num_blocks)
    seqs = [Request(i, p, SamplingParams(max_tokens,
                                          prompt_logprobs=0 if i in scored else None))
            for i, p in enumerate(prompts)]
    waiting, running = list(seqs), []
    while waiting or running:
        while waiting and kv.can_admit(waiting[0]):
            seq = waiting.pop(0)
            kv.admit(seq)
            seq.status = RequestStatus.RUNNING
            running.append(seq)
        order = [s for s in running if not s.is_prefilling] + \
            [s for s in running if s.is_prefilling]
        plan = build_plan(kv, order, step_tokens, 128)
        assert all(isinstance(op, StartSequence | FreeSequence) for op in plan.ops)
        for op in plan.ops:
            op.apply(backend)  # type: ignore[arg-type]
        for chunk, result in zip(plan.chunks, backend.step(plan.items()), strict=True):
            seq = chunk.seq
            assert len(chunk.tokens) > 1 or not seq.is_prefilling, "a lone last prompt token"
            seq.num_computed += len(chunk.tokens)
            kv.computed(seq)
            if result.sample is not None:
                seq.output_token_ids.append(result.sample.token_id)
                if len(seq.output_token_ids) == max_tokens:
                    kv.finish(seq, retain=True)
                    running.remove(seq)
        for op in kv.take_ops():
            op.apply(backend)  # type: ignore[arg-type]
    assert not backend.started and kv.num_used_blocks == 0
    return seqs, kv


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    n = len(prompt)
    return [prompt[(n + k) % n] for k in range(max_tokens)]


def test_a_plan_is_immutable_and_carries_block_tables() -> None:
    kv = PagedKVCache(64 * BS, 4)
    seq = Request(0, list(range(1, 41)), SamplingParams(8))
    kv.admit(seq)
    plan = build_plan(kv, [seq], 32, 128)
    (chunk,) = plan.chunks
    assert plan.ops == (StartSequence(0, seq.params),)
    assert chunk.tokens == tuple(range(1, 33)) and chunk.start_pos == 0
    assert len(chunk.block_table) == 3 == len(set(chunk.block_table))  # 40 + 8 tokens
    (item,) = plan.items()
    assert item.block_table == chunk.block_table and not item.sample
    assert kv.take_ops() == ()


def test_outputs_are_exact_and_a_repeated_prompt_reuses_its_blocks() -> None:
    rng = random.Random(5)
    base = [rng.randrange(1, 256) for _ in range(70)]
    prompts = [base, [*base, 9, 8, 7], base[:40], [rng.randrange(1, 256) for _ in range(50)],
               base]
    seqs, kv = run_all(prompts, 12, max_seqs=1)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == expected(prompt, 12)
    cached = [s.num_cached_tokens for s in seqs]
    # base again reuses its prompt and part of its answer: whole blocks, two tokens left
    assert cached == [0, 64, 32, 0, 64]
    assert kv.num_cached_blocks > 0


def test_concurrent_sequences_share_blocks_and_stay_exact() -> None:
    rng = random.Random(11)
    system = [rng.randrange(1, 256) for _ in range(48)]
    prompts = [[*system, *(rng.randrange(1, 256) for _ in range(rng.randrange(3, 40)))]
               for _ in range(30)]
    seqs, _ = run_all(prompts, rng.randrange(5, 20), num_blocks=40, max_seqs=4)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == expected(prompt, len(seq.output_token_ids))
    assert sum(s.num_cached_tokens > 0 for s in seqs) >= 25


def test_scored_prompts_take_nothing_from_the_cache_and_nothing_without_caching() -> None:
    prompt = list(range(1, 60))
    seqs, _ = run_all([prompt, prompt, prompt], 4, scored=frozenset({1}), max_seqs=1)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 48]
    seqs, _ = run_all([prompt, prompt], 4, prefix_caching=False, max_seqs=1)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]


def test_admission_waits_for_blocks_and_cached_blocks_make_room() -> None:
    prompts = [list(range(1, 100)), list(range(101, 200)), list(range(1, 100))]
    seqs, kv = run_all(prompts, 20, num_blocks=8, max_seqs=4)  # 119 tokens: 8 blocks each
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == expected(prompt, 20)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0]  # evicted by the second
    assert kv.capacity_tokens == 128
