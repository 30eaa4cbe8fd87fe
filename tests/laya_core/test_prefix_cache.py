"""Prefix reuse: matching, the scheduler's retained slots, and the engine end to end."""

from __future__ import annotations

import asyncio

from toy_backend import ToyBackend

from laya_core.backend import ModelConfig
from laya_core.cache import BlockCachePolicy
from laya_core.engine import Engine
from laya_core.prefix_cache import MIN_REUSE_TOKENS, best_match, common_prefix_len
from laya_core.scheduler import FcfsScheduler, SchedulerConfig
from laya_core.sequence import Sequence
from laya_core.types import SamplingParams


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(777), -1]) == 777


def test_best_match_leaves_one_token_and_ignores_short_matches() -> None:
    prompt = list(range(40))
    assert best_match(prompt, [(0, list(range(10))), (1, list(range(30)))]) == (1, 30)
    assert best_match(prompt, [(0, list(range(100)))]) == (0, 39)
    assert best_match(prompt, [(0, list(range(MIN_REUSE_TOKENS - 1)))]) is None


def seq(i: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(i, prompt, SamplingParams(max_tokens))


def run_to_end(s: FcfsScheduler, sq: Sequence) -> None:
    for chunk in s.schedule():
        chunk.seq.num_computed += len(chunk.tokens)


def test_a_finished_sequence_is_retained_and_taken_over() -> None:
    s = FcfsScheduler(SchedulerConfig(2, 64, prefix_caching=True), BlockCachePolicy(256, 16))
    first = seq(1, list(range(100, 140)))
    s.add(first)
    run_to_end(s, first)
    assert s.finish(first, retain=True)
    assert s.num_retained_blocks == 3 and s.cache.num_used_blocks == 3  # 40 tokens
    second = seq(2, [*range(100, 140), 7, 8])
    s.add(second)
    s.schedule()
    assert second.slot == first.slot and second.reuse == (first.slot, 40)
    assert second.num_computed == 40 and s.num_retained_blocks == 0


def test_retained_slots_are_evicted_when_room_is_needed() -> None:
    s = FcfsScheduler(SchedulerConfig(1, 64, prefix_caching=True), BlockCachePolicy(64, 16))
    first = seq(1, list(range(30)))
    s.add(first)
    run_to_end(s, first)
    s.finish(first, retain=True)
    other = seq(2, list(range(500, 540)), max_tokens=20)  # needs the slot and 4 blocks
    s.add(other)
    s.schedule()
    assert other.slot == first.slot and other.reuse is None
    assert s.take_evicted() == [first.slot] and s.num_retained_blocks == 0


def test_engine_reuses_a_conversation_prefix_with_the_toy_backend() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=2)
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, BlockCachePolicy)
    engine.start()
    assert engine.wait_ready(5)
    history = b"system: be brief. user: hello there, how are you today? "

    async def ask(prompt: bytes, n: int) -> str:
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=n))
        return "".join([e.text async for e in stream])

    first = asyncio.run(ask(history, 8))
    follow_up = history + b"assistant: " + first.encode() + b" user: and you?"
    second = asyncio.run(ask(follow_up, len(follow_up)))
    engine.stop()
    # The toy model repeats its prompt: right only if the reused KV held the right tokens.
    assert first == history[:8].decode()
    assert second == follow_up.decode()
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == len(history)
