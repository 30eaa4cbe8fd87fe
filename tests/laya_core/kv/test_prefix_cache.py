"""Prefix reuse on the paged layout: matching, and the engine end to end with the paged toy.

The streams layout's retained slots are the llama.cpp plugin's
(tests/backend_llamacpp/test_streams_cache.py)."""

from __future__ import annotations

import asyncio

from toy_backend import ToyBackend, follow_up_conversation, shared_prefix_workload, started_engine

from laya_core.backend import ModelConfig
from laya_core.engine.engine import Engine
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.kv.policies import PagedKVCache
from laya_core.kv.prefix import MIN_REUSE_TOKENS, best_match, common_prefix_len
from laya_core.types import SamplingParams


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(777), -1]) == 777


def test_best_match_leaves_the_last_chunk_and_ignores_short_matches() -> None:
    prompt = list(range(40))
    assert best_match(prompt, [(0, list(range(10))), (1, list(range(30)))]) == (1, 30)
    assert best_match(prompt, [(0, list(range(100)))]) == (0, 39)  # the token to sample from
    assert best_match(prompt, [(0, list(range(100)))], min_tail=2) == (0, 38)  # llama.cpp's
    assert best_match(prompt, [(0, list(range(MIN_REUSE_TOKENS - 1)))]) is None


def test_engine_reuses_a_conversation_prefix_with_the_toy_backend() -> None:
    engine = started_engine(max_seq_len=256, max_num_seqs=2)
    history, follow_up = follow_up_conversation(engine)
    # Whole blocks of 16 are reused: 48 of the 56 tokens of history.
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == 48
    assert engine.prefix_queried_tokens == len(history) + len(follow_up)


def test_many_requests_sharing_prefixes_all_get_exact_outputs() -> None:
    """More requests than slots, sharing a system prompt and repeating questions, so that
    running sequences share blocks and cached blocks are reused and evicted; the paged
    toy reads every step's history through block tables, and repeats its prompt, so any
    wrong KV shows."""
    engine = started_engine(max_seq_len=256, max_num_seqs=4, max_step_tokens=48,
                            options={"step_delay_s": 0.001})
    shared_prefix_workload(engine)
    assert engine.prefix_hits > 40
    assert engine.kv_used_tokens == 0 and engine.kv_cached_tokens > 0


class LastChunkOfThree(ToyBackend):
    min_last_prompt_chunk = 3


def test_a_reused_prefix_leaves_the_backends_last_chunk_to_compute() -> None:
    prompt = list(range(97, 97 + 34))  # 34 tokens: two whole blocks and 2 more

    async def cached_and_text(engine: Engine) -> tuple[int, str]:
        events = [e async for e in engine.submit(prompt, SamplingParams(max_tokens=6))]
        return events[-1].usage.cached_tokens, "".join(e.text for e in events)

    for backend, reused in ((ToyBackend, 32), (LastChunkOfThree, 16)):
        cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=128, max_num_seqs=2)
        engine = Engine(cfg, backend(cfg), FcfsScheduler, PagedKVCache)
        engine.start()
        assert engine.wait_ready(5)
        first, second = asyncio.run(cached_and_text(engine)), asyncio.run(cached_and_text(engine))
        engine.stop()
        # 34 - 1 leaves two whole blocks to reuse; 34 - 3, one.
        assert (first[0], second[0]) == (0, reused), backend.__name__
        assert first[1] == second[1] == bytes(prompt[:6]).decode()  # the toy repeats its prompt


def test_an_unloaded_adapters_blocks_are_never_found_again() -> None:
    """Blocks cached under adapter "a" are found by "a" alone; once "a" is unloaded, an
    adapter loaded again as "a" hashes from another salt and finds none of them."""
    from laya_core.engine.request import Request

    kv = PagedKVCache(256, 4)
    prompt = list(range(100, 148))

    def run(i: int, adapter: str | None) -> int:
        seq = Request(i, prompt, SamplingParams(4, lora=adapter))
        assert kv.can_admit(seq)
        kv.admit(seq)
        hit = seq.num_cached_tokens
        seq.num_computed = len(prompt)
        kv.finish(seq, retain=True)
        return hit

    assert [run(0, "a"), run(1, None), run(2, "a"), run(3, "b")] == [0, 0, 32, 0]
    kv.forget_adapter("a")
    assert [run(4, "a"), run(5, "a")] == [0, 32]
