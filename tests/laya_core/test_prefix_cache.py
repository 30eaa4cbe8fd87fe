"""Prefix reuse on the paged layout: matching, and the engine end to end with the paged toy.

The streams layout's retained slots are the llama.cpp plugin's
(tests/backend_llamacpp/test_streams_cache.py)."""

from __future__ import annotations

import asyncio
import random

from toy_backend import ToyBackend

from laya_core.backend import ModelConfig
from laya_core.kv_cache import PagedKVCache
from laya_core.engine import Engine
from laya_core.prefix_cache import MIN_REUSE_TOKENS, best_match, common_prefix_len
from laya_core.scheduler import FcfsScheduler
from laya_core.types import SamplingParams


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(777), -1]) == 777


def test_best_match_leaves_two_tokens_and_ignores_short_matches() -> None:
    prompt = list(range(40))
    assert best_match(prompt, [(0, list(range(10))), (1, list(range(30)))]) == (1, 30)
    assert best_match(prompt, [(0, list(range(100)))]) == (0, 38)  # a last chunk of 2
    assert best_match(prompt, [(0, list(range(MIN_REUSE_TOKENS - 1)))]) is None


def test_engine_reuses_a_conversation_prefix_with_the_toy_backend() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=2)
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, PagedKVCache)
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
    # Whole blocks of 16 are reused: 48 of the 56 tokens of history.
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == 48
    assert engine.prefix_queried_tokens == len(history) + len(follow_up)


def test_many_requests_sharing_prefixes_all_get_exact_outputs() -> None:
    """More requests than slots, sharing a system prompt and repeating questions, so that
    running sequences share blocks and cached blocks are reused and evicted; the paged
    toy reads every step's history through block tables, and repeats its prompt, so any wrong KV shows."""
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=4,
                      max_step_tokens=48, options={"step_delay_s": 0.001})
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, PagedKVCache)
    engine.start()
    assert engine.wait_ready(5)
    system = b"system: answer in one short sentence, politely. "
    questions = [b"user: why is the sky blue? ", b"user: name a prime. ",
                 b"user: what is a cat? and a dog? ", b"user: count to three. ",
                 b"user: where is Paris? ", b"user: say hi. "]
    rng = random.Random(7)
    prompts = [system + rng.choice(questions) + b"assistant:" * rng.randint(0, 1)
               for _ in range(60)]

    def expected(prompt: bytes, n: int) -> str:
        return bytes(prompt[p % len(prompt)] for p in range(len(prompt), len(prompt) + n)).decode()

    async def one(prompt: bytes, n: int) -> str:
        await asyncio.sleep(rng.random() * 0.05)
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=n))
        return "".join([e.text async for e in stream])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p, 4 + i % 9) for i, p in enumerate(prompts)))

    outputs = asyncio.run(all_of_them())
    engine.stop()
    assert outputs == [expected(p, 4 + i % 9) for i, p in enumerate(prompts)]
    assert engine.prefix_hits > 40
    assert engine.kv_used_tokens == 0 and engine.kv_cached_tokens > 0
