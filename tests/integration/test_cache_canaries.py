"""Leak canaries: prompts with a secret each, run beside neighbours that share their system
prompt, round after round, on a replica whose cache must copy, take over, move, evict, save
and restore KV to keep up. Every canary's answer must be exactly what a cold run of the same
prompt gives (a replica with prefix caching off), on both backends, with every cache feature
on. The exact path is used (llama.cpp's flash attention off, torch deterministic), so equal
means token for token and log-probability for log-probability.

Before the fix of issue 25, a stream moved out of a slot and a restore into that slot in one
step gave the moved conversation the restored prompt's KV: canaries answered with their
neighbours' text.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

pytestmark = pytest.mark.model

SYSTEM = ("You are a discreet assistant. Each user has a secret; never mention anyone "
          "else's. Answer briefly and stay on topic. ") * 2
SECRETS = ["LIGHTHOUSE", "MARIGOLD", "QUASAR", "TANGERINE", "OBSIDIAN", "WALRUS"]
EXACT = {"llamacpp": {"flash_attn": False, "n_threads": 1, "saved_kv_tokens": 2048},
         "torch": {"deterministic": True, "n_threads": 1}}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)


def start(backend: str, prefix_caching: bool) -> tuple[Deployment, Engine]:
    registry = load_registry()
    # Three slots of 256 tokens, and about 30 different prompts: cached KV is evicted,
    # saved, restored and moved all the time.
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct", "backend": backend,
        "max_seq_len": 256, "max_num_seqs": 3, "max_step_tokens": 64,
        "prefix_caching": prefix_caching, "options": EXACT[backend]}]}), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(300)
    return d, d.engines[0]


def canary(e: Engine, i: int) -> list[int]:
    return e.backend.tokenizer().encode(f"{SYSTEM}User {i}: my secret word is {SECRETS[i]}. "
                                        "Say my secret word back to me.", add_special=True)


def neighbour(e: Engine, i: int, j: int) -> list[int]:
    return e.backend.tokenizer().encode(f"{SYSTEM}Neighbour {i}-{j}: write a poem about "
                                        f"the number {i}, with {j + 2} rhymes.",
                                        add_special=True)


def loner(e: Engine, i: int) -> list[int]:
    """No shared beginning: takes a slot and pushes cached KV out."""
    return e.backend.tokenizer().encode(f"Count from {i} to {i + 40} in words, one per line.",
                                        add_special=True)


def answer(e: Engine, prompt: list[int]) -> tuple[tuple[int, ...], tuple[float, ...], int]:
    async def go() -> list:
        return [ev async for ev in e.submit(prompt, GREEDY)]

    events = asyncio.run(go())
    return outputs(events)


def outputs(events: list) -> tuple[tuple[int, ...], tuple[float, ...], int]:
    usage = events[-1].usage
    assert events[-1].error is None, events[-1].error
    tokens = tuple(t for ev in events for t in ev.token_ids)
    logprobs = tuple(s.logprob for ev in events for s in ev.samples)
    return tokens, logprobs, usage.cached_tokens if usage else 0


def rounds(e: Engine, num_rounds: int, seed: int) -> tuple[dict[int, list], int]:
    """Every canary, beside neighbours and loners, in shuffled order, ``num_rounds`` times
    over, all at once within a round; each canary's outputs, and the cached tokens used."""
    rng = random.Random(seed)
    seen: dict[int, list] = {i: [] for i in range(len(SECRETS))}
    cached = 0

    async def one(kind: str, i: int, prompt: list[int]) -> tuple[str, int, tuple]:
        await asyncio.sleep(rng.random() * 0.05)
        return kind, i, outputs([ev async for ev in e.submit(prompt, GREEDY)])

    async def a_round(r: int) -> list[tuple[str, int, tuple]]:
        jobs = [("canary", i, canary(e, i)) for i in range(len(SECRETS))]
        jobs += [("neighbour", j, neighbour(e, r * 7 + j, j)) for j in range(6)]
        jobs += [("loner", j, loner(e, r * 5 + j)) for j in range(2)]
        rng.shuffle(jobs)
        return await asyncio.gather(*(one(*job) for job in jobs))

    for r in range(num_rounds):
        for kind, i, out in asyncio.run(a_round(r)):
            cached += out[2]
            if kind == "canary":
                seen[i].append(out)
    return seen, cached


@pytest.mark.parametrize("backend", ["llamacpp", "torch"])
def test_canaries_answer_as_cold_runs_under_concurrency_and_eviction(backend: str) -> None:
    d, e = start(backend, prefix_caching=False)
    try:
        cold = {i: answer(e, canary(e, i))[:2] for i in range(len(SECRETS))}
    finally:
        d.stop()

    d, e = start(backend, prefix_caching=True)
    restores = []
    if backend == "llamacpp":  # count the restores, so the test knows it exercised them
        real = e.backend.restore_stream

        def counted(*args: object) -> None:
            restores.append(args)
            real(*args)

        e.backend.restore_stream = counted
    try:
        seen, cached = rounds(e, num_rounds=3, seed=25)
        hits = e.prefix_hits
    finally:
        d.stop()

    assert hits > 10 and cached > 0, "the cache was not exercised"
    if backend == "llamacpp":
        assert restores, "no saved KV was restored: the test did not exercise it"
    for i, outs in seen.items():
        for tokens, logprobs, _ in outs:
            assert (tokens, logprobs) == cold[i], (
                f"canary {i} ({SECRETS[i]}) answered differently from its cold run")
