"""Speculative decoding on the real model: prompt lookup and a draft model on both backends
(the embedded model, 4-bit, drafting for a float16 copy of itself: tests/draft_models.py;
on torch the copy runs dense and the draft on the int4 kernel). The output with it is the output without it, greedy and seeded
alike, alone and eight at a time; log-probabilities come with every token it keeps; and most
of a copy's tokens are kept.

Both replicas run the exact path (llama.cpp's flash attention off, torch deterministic), as
the cache canaries do, and "the same" is token for token where the replica says its rows are
(/ready's ``batch_invariant``): torch, and llama.cpp on the embedded model's Q4_1 and Q8_0
weights (Laya's build computes a draft's rows as one-row decodes,
tests/backend_llamacpp/test_exact_rows.py). llama.cpp's float16 copy, the target of the
draft-model pair, computes a several-row batch's float16 products in tiles that sum
otherwise than a one-row decode; its log-probabilities differ in the low digits, so there
greedy output is the same up to the first near-tie, where the two runs may take either of
the two likeliest tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import attrs
import pytest
from draft_models import f16_copy

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


def start(kind: str, speculative: bool) -> tuple[Deployment, Engine]:
    """A replica of ``kind``: a backend (prompt lookup), or "BACKEND-draft" (the float16
    copy, with the embedded model drafting)."""
    registry = load_registry()
    backend = kind.removesuffix("-draft")
    path = str(f16_copy()) if kind.endswith("-draft") else "embedded:smollm2-135m-instruct"
    model = {"name": "smollm2", "path": path, "backend": backend,
             "max_seq_len": 1024, "max_num_seqs": 8, "max_step_tokens": 256,
             "options": EXACT[backend]}
    if speculative and kind.endswith("-draft"):
        model["speculative"] = {"method": "draft", "num_speculative_tokens": 4,
                                "model": "embedded:smollm2-135m-instruct"}
    elif speculative:
        model["speculative"] = {"method": "ngram", "num_speculative_tokens": 4}
    else:
        model["speculative"] = False  # absent, the default would draft where rows are exact
    d = Deployment(mf.resolve(mf.from_dict({"models": [model]}), registry), registry)
    d.start()
    assert d.wait_ready(300), d.engines[0].error
    return d, d.engines[0]


@attrs.frozen
class Pair:
    backend: str
    plain: Engine
    spec: Engine

    @property
    def exact(self) -> bool:
        """Whether the replicas' rows are the same bits in any batch (/ready)."""
        return bool(self.plain.runtime().get("batch_invariant"))


@pytest.fixture(scope="module", params=["llamacpp", "torch", "llamacpp-draft", "torch-draft"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    plain, spec = start(request.param, False), start(request.param, True)
    yield Pair(request.param.removesuffix("-draft"), plain[1], spec[1])
    plain[0].stop()
    spec[0].stop()


@attrs.frozen
class Output:
    ids: list[int]
    logprobs: list[float]
    tops: list[tuple[tuple[int, float], ...]]


def run(e: Engine, params: list[SamplingParams], prompts: list[str] = PROMPTS,
        at_once: bool = True) -> list[Output]:
    """Each prompt with its params: all at once, or one after another."""
    tok = e.backend.tokenizer()

    async def one(prompt: str, p: SamplingParams) -> Output:
        out = Output([], [], [])
        async for event in e.submit(tok.encode(prompt, add_special=True), p):
            out.ids.extend(event.token_ids)
            out.logprobs.extend(s.logprob for s in event.samples if s.logprob is not None)
            out.tops.extend(s.top for s in event.samples)
        return out

    async def all_of_them() -> list[Output]:
        return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params,
                                                                      strict=True)))

    if at_once:
        return asyncio.run(all_of_them())
    return [asyncio.run(one(pr, p)) for pr, p in zip(prompts, params, strict=True)]


# Two tokens this close in log-probability may change places between llama.cpp's one-row
# and several-row float16 kernels, once their differences have added up over a few dozen
# tokens (measured: 0.107 apart at token 27 of a copy, eight at once).
NEAR_TIE = 0.25


def divergence(got: list[int], want: list[int]) -> int | None:
    """Where two token lists first differ (None: nowhere, as far as the shorter goes)."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def same(pair: Pair, got: Output, want: Output) -> bool:
    """``got`` has ``want``'s tokens; or, where the replicas' rows are not exact, differs
    first where ``want``'s two likeliest tokens were a near-tie, and took the other one."""
    if got.ids == want.ids or pair.exact:
        return got.ids == want.ids
    i = divergence(got.ids, want.ids)
    if i is None or not want.tops:
        return False  # one is a prefix of the other: an end token where there was none
    (first, lp1), (second, lp2) = want.tops[i][:2]
    return lp1 - lp2 < NEAR_TIE and {got.ids[i], want.ids[i]} == {first, second}


def first_difference(got: Output, want: Output) -> str:
    i = divergence(got.ids, want.ids)
    if i is None:
        return f"same up to {min(len(got.ids), len(want.ids))} ({len(got.ids)}, {len(want.ids)})"
    return f"at {i}: {got.ids[i]} for {want.ids[i]}, where {want.tops[i]} / {got.tops[i]}"


GREEDY = [SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)] * len(PROMPTS)
SEEDED = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=100 + i,
                         repetition_penalty=1.05) for i in range(len(PROMPTS))]


def test_greedy_alone_is_the_same_with_drafts(pair: Pair) -> None:
    before = pair.spec.speculative.num_accepted_tokens
    got = run(pair.spec, GREEDY, at_once=False)
    want = run(pair.plain, GREEDY, at_once=False)
    assert all(same(pair, g, w) for g, w in zip(got, want, strict=True)), \
        [(g.ids, w.ids) for g, w in zip(got, want, strict=True) if g.ids != w.ids]
    assert pair.spec.speculative.num_accepted_tokens > before  # drafts were kept


def test_eight_at_once_greedy_and_seeded_are_the_same_with_drafts(pair: Pair) -> None:
    greedy_got, greedy_want = run(pair.spec, GREEDY), run(pair.plain, GREEDY)
    assert all(same(pair, g, w) for g, w in zip(greedy_got, greedy_want, strict=True)), \
        [first_difference(g, w) for g, w in zip(greedy_got, greedy_want, strict=True)]
    # Each kept token has its log-probability, the model's own.
    for g, w in zip(greedy_got, greedy_want, strict=True):
        assert len(g.logprobs) == len(g.ids)
        at = divergence(g.ids, w.ids)
        agree = len(g.ids) if at is None else at
        if pair.exact:
            assert g.logprobs == w.logprobs  # the same bits
        else:
            assert g.logprobs[:agree] == pytest.approx(w.logprobs[:agree], abs=NEAR_TIE)
    seeded_got, seeded_want = run(pair.spec, SEEDED), run(pair.plain, SEEDED)
    matches = sum(g.ids == w.ids for g, w in zip(seeded_got, seeded_want, strict=True))
    # A seeded request draws once per output token with or without drafts, so the draws
    # are the same; where rows are not exact, their low digits may still move one across a
    # boundary between two tokens, rarely.
    assert matches == len(PROMPTS) if pair.exact else matches >= len(PROMPTS) - 2


def test_a_copy_keeps_most_drafts(pair: Pair) -> None:
    stats = pair.spec.speculative
    drafted, kept = stats.num_draft_tokens, stats.num_accepted_tokens
    run(pair.spec, GREEDY[:1], PROMPTS[2:3])
    assert stats.num_draft_tokens > drafted
    assert (stats.num_accepted_tokens - kept) / (stats.num_draft_tokens - drafted) > 0.5


LISTED = " banana, cherry, date, fig, grape."
CONSTRAINED = [  # (the prompt, a regular expression or a JSON schema its output must follow)
    (PROMPTS[1].replace("elderberry, fig, grape", "elderberry"), LISTED.replace(".", "\\.")),
    (f"Copy this file as a JSON string.\n\n{CODE}\nAs JSON: ",
     {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"]}),
    (PROMPTS[3], {"type": "object", "properties": {"title": {"type": "string"}, "words": {
        "type": "integer"}}, "required": ["title", "words"]})]


def constrained(e: Engine, params: SamplingParams) -> list[Output]:
    """CONSTRAINED's prompts under their constraints (structured output's compiler), all at
    once."""
    from laya_core.structured import formats
    from laya_core.structured.compiler import GrammarCompiler

    assert e.tokenizer is not None and e.info is not None
    compiler = GrammarCompiler(e.tokenizer, e.info)

    async def one(prompt: str, rule: object) -> Output:
        spec = formats.regex(rule, "pattern") if isinstance(rule, str) \
            else formats.json_schema(rule, "schema")
        out = Output([], [], [])
        async for event in e.submit(e.tokenizer.encode(prompt, add_special=True), params,
                                    constraint=compiler.constraint(spec)):
            out.ids.extend(event.token_ids)
            out.tops.extend(s.top for s in event.samples)
        return out

    async def all_of_them() -> list[Output]:
        return await asyncio.gather(*(one(p, r) for p, r in CONSTRAINED))

    return asyncio.run(all_of_them())


def test_constrained_output_is_the_same_with_drafts(pair: Pair) -> None:
    """Structured output with drafts: each checked row samples under its own mask, so
    greedy and seeded output under a pattern or a schema are the plain replica's, at once
    (the list's pattern wants a comma where the prompt has a period, so the row after
    "date" is checked under a mask that refuses what the model would say), and drafts were
    kept."""
    before = pair.spec.speculative.num_accepted_tokens
    greedy = SamplingParams(max_tokens=64, temperature=0.0, logprobs=2)
    got, want = constrained(pair.spec, greedy), constrained(pair.plain, greedy)
    assert all(same(pair, g, w) for g, w in zip(got, want, strict=True)), \
        [first_difference(g, w) for g, w in zip(got, want, strict=True)]
    assert pair.spec.tokenizer is not None
    assert pair.spec.tokenizer.decode(got[0].ids) == LISTED
    assert pair.spec.speculative.num_accepted_tokens > before
    seeded = SamplingParams(max_tokens=48, temperature=0.8, seed=7)
    got, want = constrained(pair.spec, seeded), constrained(pair.plain, seeded)
    assert pair.spec.tokenizer.decode(got[0].ids) == LISTED
    # Where rows are not exact (llama.cpp's float16 copy), the kept draft tokens' KV comes
    # from several-row batches whose low digits differ: over a few dozen tokens a row's
    # log-probabilities moved by up to 0.09 (measured, a schema's 28th token), enough to
    # move a seeded draw across a boundary.
    if pair.exact:
        assert [g.ids for g in got] == [w.ids for w in want]


def chi_square_p(a: list[int], b: list[int]) -> float:
    """The p-value of a two-sample chi-square test that ``a`` and ``b`` (equally many draws
    of a category) come from one distribution. Categories seen fewer than 10 times in both
    together are pooled; the tail is the Wilson-Hilferty normal approximation."""
    import collections
    import math

    ca, cb = collections.Counter(a), collections.Counter(b)
    rare = {k for k in ca | cb if ca[k] + cb[k] < 10}
    pooled = [(sum(ca[k] for k in rare), sum(cb[k] for k in rare))] if rare else []
    cells = [(ca[k], cb[k]) for k in (ca | cb).keys() - rare] + pooled
    if len(cells) < 2:
        return 1.0
    x = sum((i - j) ** 2 / (i + j) for i, j in cells if i + j)  # equal sample sizes
    k = len(cells) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_output_keeps_the_models_distribution(pair: Pair) -> None:
    """Rejection sampling, checked statistically: the second to fourth tokens of 160 sampled
    continuations of a list (where drafts are proposed and kept), drawn with seeds 0-159
    without drafts and 1000-1159 with them (other draws, not the same ones again), come from
    one distribution: a chi-square test of the two samples, p > 0.001, with fixed seeds."""
    n, prompt = 160, PROMPTS[1]

    def tails(e: Engine, seeds: range) -> list[int]:
        params = [SamplingParams(max_tokens=4, temperature=1.5, top_k=8, seed=s)
                  for s in seeds]
        outs: list[Output] = []
        for i in range(0, n, 8):
            outs += run(e, params[i:i + 8], [prompt] * len(params[i:i + 8]))
        return [hash(tuple(o.ids[1:4])) for o in outs]

    before = pair.spec.speculative.num_accepted_tokens
    plain, spec = tails(pair.plain, range(n)), tails(pair.spec, range(1000, 1000 + n))
    assert pair.spec.speculative.num_accepted_tokens > before  # drafts were kept
    assert len(set(plain)) > 3  # a distribution, not one answer
    assert chi_square_p(plain, spec) > 1e-3
    # ... and the test can tell: the draws against always the likeliest continuation.
    assert chi_square_p(plain, [max(set(plain), key=plain.count)] * n) < 1e-3


def served_manifest() -> str:
    from conftest import SMOLLM_MANIFEST

    return SMOLLM_MANIFEST.replace("max_num_seqs = 8\nembeddings = true", (
        'max_num_seqs = 2\nspeculative = { method = "ngram", num_speculative_tokens = 4 }\n\n'
        "[models.options]\nn_threads = 1"))


def _final_timing(url: str, body: dict[str, object]) -> dict[str, float]:
    import httpx

    timing: dict[str, float] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"model": "smollm2", "stream": True, "max_tokens": 64,
                            "temperature": 0, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                timing = json.loads(line[6:]).get("laya_timing", timing)
    return timing


def test_served_drafts_show_in_the_timing_metrics_and_live_page(tmp_path) -> None:
    import httpx
    from conftest import serving

    copy = {"messages": [{"role": "user", "content": "Repeat this list exactly: " +
                          ", ".join(f"item {i}" for i in range(40))}]}
    with serving(served_manifest(), tmp_path) as server:
        timing = _final_timing(server.url, copy)
        assert 0 < timing["spec_accepted_tokens"] <= timing["spec_draft_tokens"]
        # A request that opts out has no drafts, and says none.
        assert "spec_draft_tokens" not in _final_timing(server.url,
                                                        {**copy, "speculative": False})
        # The replica's counters: the first request's drafts, none of the second's.
        metrics = httpx.get(f"{server.url}/metrics").text
        drafted = [line for line in metrics.splitlines()
                   if line.startswith("laya:spec_decode_num_draft_tokens_total{")]
        assert drafted and float(drafted[0].split()[-1]) == timing["spec_draft_tokens"]
        (replica,) = httpx.get(f"{server.url}/live").json()["models"][0]["replicas"]
        assert replica["speculative"] == {"drafts": replica["speculative"]["drafts"],
                                          "draft_tokens": timing["spec_draft_tokens"],
                                          "accepted_tokens": timing["spec_accepted_tokens"]}
        # A wrong type is refused naming the field.
        bad = httpx.post(f"{server.url}/v1/chat/completions",
                         json={**copy, "model": "smollm2", "speculative": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
        # Structured output drafts too, through the worker's own compiled matchers, and its
        # answer still follows the schema.
        listed = {"type": "json_schema", "json_schema": {"name": "items", "schema": {
            "type": "array", "items": {"type": "string"}}}}
        timing = _final_timing(server.url, {**copy, "response_format": listed,
                                            "max_tokens": 200})
        assert 0 < timing["spec_accepted_tokens"] <= timing["spec_draft_tokens"]
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            **copy, "model": "smollm2", "max_tokens": 400, "temperature": 0,
            "response_format": listed}).json()["choices"][0]
        if answer["finish_reason"] == "stop":
            assert all(isinstance(x, str) for x in json.loads(answer["message"]["content"]))


def _default_replica(backend: str, options: dict[str, object],
                     speculative: bool | None = None) -> Deployment:
    registry = load_registry()
    model = {"name": "smollm2", "path": "embedded:smollm2-135m-instruct", "backend": backend,
             "max_seq_len": 1024, "max_num_seqs": 4, "options": options}
    if speculative is not None:
        model["speculative"] = speculative
    d = Deployment(mf.resolve(mf.from_dict({"models": [model]}), registry), registry)
    d.start()
    assert d.wait_ready(300), d.engines[0].error
    return d


@pytest.mark.parametrize(("backend", "options", "drafts"), [
    ("llamacpp", {}, True), ("torch", {}, True),
    ("torch", {"dtype": "float32", "quantize": "none"}, False)],
    ids=["llamacpp", "torch", "torch-float32"])
def test_the_default_drafts_only_where_drafts_change_nothing(
        backend: str, options: dict[str, object], drafts: bool) -> None:
    """Without a ``speculative`` key a model gets prompt lookup where its replica says drafts
    change no output: its rows are exact in any batch (llama.cpp on the embedded model,
    flash attention off as by default: ``batch_invariant``) or a check gives its rows a lone
    decode's bits (torch's 16-bit and integer products: ``exact_drafts``), and none where
    neither holds (torch's float32 products change with the row count); an adapter's
    requests and steps of more than two sequences draft nothing either (spec/manifest.md).
    Where it drafts, a copy's greedy tokens and log-probabilities are those of the same
    replica without drafts."""
    d = _default_replica(backend, options)
    try:
        e = d.engines[0]
        runtime = e.runtime()
        assert bool(runtime.get("batch_invariant") or runtime.get("exact_drafts")) is drafts
        if drafts:  # the backend's length: torch's int4 kernel takes rows four at a time
            length = {"llamacpp": 4, "torch": 3}[backend]
            assert f"drafts of up to {length} tokens" in str(runtime["speculative"])
        (with_drafts,) = run(e, GREEDY[:1], PROMPTS[2:3])  # a copy
        assert (e.speculative.num_drafts > 0) is drafts
    finally:
        d.stop()
    if not drafts:
        return
    d = _default_replica(backend, options, speculative=False)
    try:
        (plain,) = run(d.engines[0], GREEDY[:1], PROMPTS[2:3])
    finally:
        d.stop()
    assert with_drafts.ids == plain.ids
    assert with_drafts.logprobs == plain.logprobs
