"""A multi-turn chat on the real model: later turns reuse the conversation's KV."""

from __future__ import annotations

import asyncio
import time

import backend_steps as steps
import pytest

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.chat_template import ChatTemplate
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

SYSTEM = ("You are a patient tutor. " + "Explain every answer step by step, use short "
          "sentences, and check the student's understanding before moving on. " * 12)
QUESTIONS = ["What is a prime number?", "Is 21 a prime number?", "And 23?"]
# The runs compared here must compute alike: a fixed thread count, since llama.cpp's flash
# attention splits its work by thread ("auto" may change the count under load). Where a test
# drives the backend on pytest's main thread, one thread, so that no OpenMP team outlives it
# (see test_llamacpp_backend.reference_completion).
THREADS = 2


def engine(prefix_caching: bool) -> tuple[Deployment, Engine]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 2048,
        "max_num_seqs": 2, "prefix_caching": prefix_caching,
        "options": {"n_threads": THREADS}}]}), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(60)
    return d, d.engines[0]


def conversation(e: Engine) -> tuple[list[str], list[float]]:
    """Three turns at temperature 0; the answers and each turn's time to first token."""
    info = e.info
    assert info is not None
    template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    messages = [{"role": "system", "content": SYSTEM}]
    answers, ttfts = [], []

    async def turn(prompt: list[int]) -> tuple[str, float]:
        started = time.perf_counter()
        first = None
        parts = []
        async for event in e.submit(prompt, SamplingParams(max_tokens=24, temperature=0.0)):
            first = first or time.perf_counter()
            parts.append(event.text)
        return "".join(parts), (first or started) - started

    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        prompt = e.backend.tokenize(template.render(messages), add_special=True)
        answer, ttft = asyncio.run(turn(prompt))
        answers.append(answer)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})
    return answers, ttfts


@pytest.fixture(scope="module")
def runs() -> dict[bool, tuple[list[str], list[float], int, int]]:
    out = {}
    for caching in (False, True):
        d, e = engine(caching)
        answers, ttfts = conversation(e)
        out[caching] = (answers, ttfts, e.prefix_hits, e.prefix_tokens_reused)
        d.stop()
    return out


def test_later_turns_reuse_the_conversation(runs: dict) -> None:
    answers, ttfts, hits, reused = runs[True]
    plain_answers, plain_ttfts, plain_hits, _ = runs[False]
    print(f"\nTTFT per turn without reuse: {[f'{t * 1000:.0f} ms' for t in plain_ttfts]}; "
          f"with reuse: {[f'{t * 1000:.0f} ms' for t in ttfts]} ({reused} tokens reused)")
    assert plain_hits == 0
    assert hits == len(QUESTIONS) - 1 and reused > 2 * 200
    # The first turn has nothing to reuse; later turns start from the cached conversation.
    assert answers[0] == plain_answers[0]
    # Each slot has its own KV stream, so reused cells hold exactly what a fresh prefill
    # computes: the answers are the same, token for token.
    assert answers == plain_answers


@pytest.mark.parametrize("kv_unified", [False, True])
def test_a_running_sequence_lends_its_prefix(kv_unified: bool) -> None:
    """The second request arrives while the first still runs and copies its prefix."""
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 1024,
        "max_num_seqs": 2, "options": {"kv_unified": kv_unified, "n_threads": THREADS}}]}),
        registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(60)
    e = d.engines[0]
    shared = e.backend.tokenize(SYSTEM, add_special=True)
    first = shared + e.backend.tokenize(" Question one: what is two plus two?", add_special=False)
    second = shared + e.backend.tokenize(" Question two: name a planet.", add_special=False)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    async def both() -> tuple[list[int], list[int]]:
        long_run = e.submit(first, SamplingParams(max_tokens=64, temperature=0.0))
        events = aiter(long_run)
        await anext(events)  # the first is running: its prompt is in the cache
        lent = [t async for ev in e.submit(second, greedy) for t in ev.token_ids]
        long_run.cancel()
        return lent, [t async for ev in events for t in ev.token_ids]

    async def alone(on: Engine, prompt: list[int]) -> list[int]:
        return [t async for ev in on.submit(prompt, greedy) for t in ev.token_ids]

    lent, _ = asyncio.run(both())
    hits = e.prefix_hits
    d.stop()
    d2, e2 = engine(False)
    expected = asyncio.run(alone(e2, second))
    d2.stop()
    assert hits >= 1
    assert lent == expected


@pytest.mark.parametrize("kv_unified", [False, True])
def test_moved_kv_continues_exactly_as_before(kv_unified: bool) -> None:
    """The scheduler moves retained KV out of a slot (share, then free); a sequence that
    takes it over at its new slot continues as the original would have."""
    from laya_backend_llamacpp.backend import LlamaCppBackend

    from laya_core.backend import ModelConfig
    from laya_core.builtin.model_paths import embedded_file

    config = ModelConfig(name="m", backend="llamacpp", path=embedded_file("smollm2-135m-instruct"),
                         max_seq_len=512, max_num_seqs=4,
                         options={"kv_unified": kv_unified, "n_threads": 1})
    b = LlamaCppBackend(config)
    b.load_weights()
    b.allocate_cache(n_ctx=2048, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = b.tokenize(SYSTEM[:300] + " Question: what is a prime number?", add_special=True)
    other = b.tokenize("A different text that overwrites slot one.", add_special=True)

    def generate(slot: int, fed: list[int], start: int, n: int = 8) -> list[int]:
        return [s.token_id for s in steps.generate(b, slot, fed, start, n)]

    try:
        b.start_sequence(1, greedy)
        expected = generate(1, prompt, 0)
        b.share_prefix(1, 3, len(prompt) - 1)  # slot 1 holds the prompt and the answer
        b.free_sequence(1)
        b.start_sequence(1, greedy)  # slot 1 now holds something else
        generate(1, other, 0, n=2)
        b.start_sequence(3, greedy, keep_tokens=len(prompt) - 1)
        assert generate(3, prompt[-1:], len(prompt) - 1) == expected
    finally:
        b.close()


def test_a_running_sequence_moved_to_another_slot_continues_exactly() -> None:
    """Compaction moves a running sequence mid-generation: its KV and its sampler (here a
    seeded draw, whose random state must move too) carry on as if nothing happened."""
    from laya_backend_llamacpp.backend import LlamaCppBackend

    from laya_core.backend import ModelConfig, StepItem
    from laya_core.builtin.model_paths import embedded_file

    config = ModelConfig(name="m", backend="llamacpp", path=embedded_file("smollm2-135m-instruct"),
                         max_seq_len=512, max_num_seqs=4, options={"n_threads": 1})
    b = LlamaCppBackend(config)
    b.load_weights()
    b.allocate_cache(n_ctx=2048, max_num_seqs=4)
    assert b.supports_moving  # a stream per slot
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=42)
    prompt = b.tokenize("Once upon a time, in a small village by the sea,", add_special=True)

    def run(move_after: int | None) -> list[int]:
        b.start_sequence(2, params)
        slot, fed, start, out = 2, prompt, 0, []
        for i in range(12):
            if i == move_after:
                b.move_sequence(2, 0, start)
                slot = 0
            sample = b.step([StepItem(slot, fed, start, True)])[0].sample
            assert sample is not None
            out.append(sample.token_id)
            start, fed = start + len(fed), [sample.token_id]
        b.free_sequence(slot)
        return out

    try:
        assert run(move_after=6) == run(move_after=None)
    finally:
        b.close()


@pytest.mark.parametrize("kv_unified", [False, True])
def test_saved_kv_restored_into_another_slot_continues_exactly(kv_unified: bool) -> None:
    """An evicted stream's KV saved to host memory (save_stream) and restored into another
    slot (restore_stream) continues as a fresh prefill does: tokens and log-probabilities
    bit for bit, with flash attention off. The state is the KV plus 16 bytes a cell, as the
    memory plan counts it."""
    from laya_backend_llamacpp.backend import LlamaCppBackend
    from laya_backend_llamacpp.memory import SAVED_CELL_BYTES

    from laya_core.backend import ModelConfig
    from laya_core.builtin.model_paths import embedded_file

    config = ModelConfig(name="m", backend="llamacpp", path=embedded_file("smollm2-135m-instruct"),
                         max_seq_len=512, max_num_seqs=4,
                         options={"kv_unified": kv_unified, "n_threads": 1, "flash_attn": False})
    b = LlamaCppBackend(config)
    b.load_weights()
    b.allocate_cache(n_ctx=2048, max_num_seqs=4)
    assert b.saved_kv_tokens == 512  # a quarter of the pool
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    prompt = b.tokenize(SYSTEM[:300] + " Question: what is a prime number?", add_special=True)

    def generate(slot: int, fed: list[int], start: int, n: int = 8) -> list[object]:
        return list(steps.generate(b, slot, fed, start, n))

    try:
        b.start_sequence(1, greedy)
        generate(1, prompt, 0, n=3)  # slot 1 holds the prompt and part of an answer
        b.save_stream(1, key=5)
        per_token = 2 * 30 * 3 * 64 * 2  # f16 K and V, 30 layers, 3 KV heads of 64
        assert b._saved[5].nbytes <= (len(prompt) + 2) * (per_token + SAVED_CELL_BYTES) + 4096
        b.free_sequence(1)
        b.start_sequence(2, greedy)
        b.restore_stream(5, 2, len(prompt) - 2)
        restored = generate(2, prompt[-2:], len(prompt) - 2)
        b.free_sequence(2)
        b.start_sequence(0, greedy)
        assert restored == generate(0, prompt, 0)
        b.forget_saved(5)  # already restored: nothing left, and no error
    finally:
        b.close()
