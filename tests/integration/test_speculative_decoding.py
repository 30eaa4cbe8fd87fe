"""Speculative decoding (prompt lookup) on the real model, both backends: the output with it
is the output without it, token for token, greedy and seeded alike, alone and eight at a time;
log-probabilities come with every token it keeps; and most of a copy's tokens are kept.

Both replicas run the exact path (llama.cpp's flash attention off, torch deterministic), as
the cache canaries do, so that "equal" can mean every token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

pytestmark = pytest.mark.model

EXACT = {"llamacpp": {"flash_attn": False, "n_threads": 1},
         "torch": {"deterministic": True, "n_threads": 1}}
CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((value - m) ** 2 for value in values) / len(values)
"""
PROMPTS = [
    # Copies: the continuation repeats what the prompt holds.
    f"Here is a Python file:\n\n{CODE}\nThe same file, with `values` renamed to `xs`:\n\n",
    "The list: apple, banana, cherry, date, elderberry, fig, grape.\nThe list again: apple,",
    f"{CODE}\n# Again, word for word:\n{CODE[:40]}",
    # Nothing to copy.
    "Write a short story about a lighthouse keeper who finds a map.",
    "Name three rivers in Europe and say where each one meets the sea.",
    "What is 17 times 23? Think it through.",
    "The capital of France is",
    "Once upon a time",
]


def start(backend: str, speculative: bool) -> tuple[Deployment, Engine]:
    registry = load_registry()
    model = {"name": "smollm2", "path": "embedded:smollm2-135m-instruct", "backend": backend,
             "max_seq_len": 1024, "max_num_seqs": 8, "max_step_tokens": 256,
             "options": EXACT[backend]}
    if speculative:
        model["speculative"] = {"method": "ngram", "num_speculative_tokens": 4}
    d = Deployment(mf.resolve(mf.from_dict({"models": [model]}), registry), registry)
    d.start()
    assert d.wait_ready(300), d.engines[0].error
    return d, d.engines[0]


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    plain, spec = start(request.param, False), start(request.param, True)
    yield plain[1], spec[1]
    plain[0].stop()
    spec[0].stop()


def run(e: Engine, params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    """Every prompt with its params, all at once; each one's tokens and log-probabilities."""
    tok = e.backend.tokenizer()

    async def one(prompt: str, p: SamplingParams) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        logprobs: list[float] = []
        async for event in e.submit(tok.encode(prompt, add_special=True), p):
            ids += event.token_ids
            logprobs += [s.logprob for s in event.samples if s.logprob is not None]
        return ids, logprobs

    async def all_of_them() -> list[tuple[list[int], list[float]]]:
        return await asyncio.gather(*(one(pr, p) for pr, p in zip(PROMPTS, params,
                                                                      strict=True)))

    return asyncio.run(all_of_them())


def one_at_a_time(e: Engine, params: list[SamplingParams],
                  prompts: list[str] = PROMPTS) -> list[list[int]]:
    tok = e.backend.tokenizer()

    async def one(prompt: str, p: SamplingParams) -> list[int]:
        return [t async for event in e.submit(tok.encode(prompt, add_special=True), p)
                for t in event.token_ids]

    return [asyncio.run(one(pr, p)) for pr, p in zip(prompts, params, strict=True)]


GREEDY = [SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)] * len(PROMPTS)
SEEDED = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=100 + i,
                         repetition_penalty=1.05) for i in range(len(PROMPTS))]


def test_greedy_alone_is_the_same_with_drafts(pair: tuple[Engine, Engine]) -> None:
    plain, spec = pair
    before = spec.speculative.num_accepted_tokens
    assert one_at_a_time(spec, GREEDY) == one_at_a_time(plain, GREEDY)
    assert spec.speculative.num_accepted_tokens > before  # drafts were kept, not skipped


def test_eight_at_once_greedy_and_seeded_are_the_same_with_drafts(
        pair: tuple[Engine, Engine]) -> None:
    plain, spec = pair
    for params in (GREEDY, SEEDED):
        want, got = run(plain, params), run(spec, params)
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
    # Each kept token has its log-probability, the model's own.
    for (ids, logprobs), (_, want_lp) in zip(run(spec, GREEDY), run(plain, GREEDY),
                                             strict=True):
        assert len(logprobs) == len(ids)
        assert logprobs == pytest.approx(want_lp, abs=0.05)


def test_a_copy_keeps_most_drafts(pair: tuple[Engine, Engine]) -> None:
    _, spec = pair
    stats = spec.speculative
    drafted, kept = stats.num_draft_tokens, stats.num_accepted_tokens
    one_at_a_time(spec, GREEDY[:1], PROMPTS[:1])
    assert stats.num_draft_tokens > drafted
    assert (stats.num_accepted_tokens - kept) / (stats.num_draft_tokens - drafted) > 0.5
