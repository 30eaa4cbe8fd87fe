"""A multi-turn chat on the real model: later turns reuse the conversation's KV."""

from __future__ import annotations

import asyncio
import time

import pytest

from laya_core import manifest as mf
from laya_core.chat_template import ChatTemplate
from laya_core.deployment import Deployment
from laya_core.engine import Engine
from laya_core.plugins import load_registry
from laya_core.types import SamplingParams

SYSTEM = ("You are a patient tutor. " + "Explain every answer step by step, use short "
          "sentences, and check the student's understanding before moving on. " * 12)
QUESTIONS = ["What is a prime number?", "Is 21 a prime number?", "And 23?"]


def engine(prefix_caching: bool) -> tuple[Deployment, Engine]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 2048,
        "max_num_seqs": 2, "prefix_caching": prefix_caching}]}), registry)
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
        "max_num_seqs": 2, "options": {"kv_unified": kv_unified}}]}), registry)
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
