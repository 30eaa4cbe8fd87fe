"""What every backend must do, checked on the backend named by ``--laya-backend``.

Run by ``pytest -p laya_core.testing.plugin --pyargs laya_core.testing.test_conformance``
(laya_core/testing/__init__.py). The step-level tests (``laya_engine``) drive the real
engine, scheduler and cache policy of one replica through ``Engine.submit``; an
engine-level backend (``kind = "engine"``) has none of them, so they are skipped for it,
saying why. The tests of the replica's ``EngineClient`` (``laya_client``, at the end) hold
every backend to what the HTTP side relies on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from laya_core.engine.allowed_tokens import AllowedTokens
from laya_core.engine.engine import Engine
from laya_core.replica.client import (
    EngineClient,
    GrammarError,
    RequestTooLongError,
    UnsupportedParameterError,
)
from laya_core.serving.deployment import Deployment
from laya_core.types import FinishReason, Sample, SamplingParams, Usage

LONG = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
        "the steps, listening to the sea, and lighting the great lamp that guided the "
        "fishing boats home through the fog and the storms of the northern coast.")
TEXTS = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,",
         "Le café est très bon, n'est-ce pas ?", "日本語のテキストと絵文字 🎉 を書く"]


@attrs.frozen
class Run:
    tokens: tuple[int, ...]
    texts: tuple[str, ...]  # each event's text, as a client is sent it
    finish: FinishReason
    usage: Usage
    samples: tuple[Sample, ...] = ()  # with log-probabilities, where asked for

    @property
    def text(self) -> str:
        return "".join(self.texts)


def ids(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(text, add_special=True)


async def one(engine: Engine, prompt: list[int], params: SamplingParams,
              constraint: Any = None, cancel_after: int | None = None) -> Run:
    stream = engine.submit(prompt, params, constraint=constraint)
    tokens: list[int] = []
    texts: list[str] = []
    samples: list[Sample] = []
    async for event in stream:
        tokens += event.token_ids
        texts.append(event.text)
        samples += event.samples
        if cancel_after is not None and len(tokens) >= cancel_after:
            stream.cancel()
        if event.finish_reason is not None:
            assert event.usage is not None
            return Run(tuple(tokens), tuple(texts), event.finish_reason, event.usage,
                       tuple(samples))
    raise AssertionError("the stream ended without a finish reason")


def run(engine: Engine, prompt: list[int], **params: Any) -> Run:
    return asyncio.run(one(engine, prompt, SamplingParams(**params)))


def together(engine: Engine, *requests: tuple[list[int], dict[str, Any]]) -> list[Run]:
    async def go() -> list[Run]:
        return list(await asyncio.gather(*(one(engine, p, SamplingParams(**kw))
                                           for p, kw in requests)))
    return asyncio.run(go())


def idle(engine: Engine) -> None:
    """Nothing runs, waits or holds KV: the state every test leaves the replica in."""
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.kv_used_tokens == 0, f"{engine.kv_used_tokens} KV tokens still reserved"


def test_the_memory_profile_is_sane_and_is_what_the_replica_holds(
        laya_deployment: Deployment, laya_engine: Engine, laya_rss_growth: int) -> None:
    config = laya_engine.config
    backend_cls = type(laya_engine.backend)
    profile = backend_cls.memory_profile(config, backend_cls.model_shape(config.path))
    assert profile.weights_bytes > 0 and profile.kv_bytes_per_token > 0
    for overhead in profile.overheads:
        assert overhead.bytes >= 0 and overhead.name and overhead.how, overhead
    assert laya_deployment.plan is not None
    (ledger,) = laya_deployment.plan.replicas
    planned_tokens = config.kv_cache_tokens
    assert planned_tokens is not None and ledger.pool_tokens == planned_tokens
    assert ledger.kv_pool_bytes == profile.kv_bytes_per_token * planned_tokens
    # The pool the cache policy allocated holds the planned tokens, less at most one
    # block's rounding.
    assert planned_tokens - 16 < laya_engine.kv_capacity_tokens <= planned_tokens
    # Loaded and allocated, the replica holds no more than its ledger says (the ledger's
    # tolerance for the KV pool; a backend that maps its weights lazily holds less).
    assert laya_rss_growth <= ledger.total_bytes * 1.10, (
        f"the replica grew the process by {laya_rss_growth / 2**20:.1f} MiB; its ledger "
        f"says {ledger.total_bytes / 2**20:.1f} MiB")


def test_chunked_prefill_and_decode_give_the_tokens_of_a_lone_run(laya_engine: Engine) -> None:
    """A prompt longer than a step is prefilled in chunks; its greedy tokens are the same
    alone and while other sequences join and leave the batch around it."""
    prompt = ids(laya_engine, LONG)
    assert len(prompt) > 32  # longer than the suite's max_step_tokens
    alone = run(laya_engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert len(alone.tokens) == 24 and alone.finish is FinishReason.LENGTH
    crowd = together(laya_engine,
                     (prompt, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}),
                     (ids(laya_engine, TEXTS[0]), {"max_tokens": 3, "temperature": 0.0}),
                     (ids(laya_engine, TEXTS[1]), {"max_tokens": 17, "temperature": 0.0,
                                                    "ignore_eos": True}),
                     (ids(laya_engine, TEXTS[2]), {"max_tokens": 9, "temperature": 0.0,
                                                    "ignore_eos": True}))
    assert crowd[0].tokens == alone.tokens
    assert [len(r.tokens) for r in crowd[2:]] == [17, 9]
    idle(laya_engine)


def test_a_repeated_prompt_reuses_its_cached_prefix(laya_engine: Engine) -> None:
    block = laya_engine.backend.block_size  # the backend's own (Backend.block_size)
    text = LONG
    while len(ids(laya_engine, text)) < block + 8:  # at least one whole block to reuse
        text += " " + LONG
    prompt = ids(laya_engine, text + " Again:")
    first = run(laya_engine, prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    second = run(laya_engine, prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert second.usage.cached_tokens >= block, second.usage  # a block, not copied
    assert second.usage.cached_tokens < len(prompt)  # the last token is always computed
    assert second.tokens == first.tokens
    idle(laya_engine)


def test_cancelling_frees_everything(laya_engine: Engine) -> None:
    prompt = ids(laya_engine, TEXTS[0])
    cancelled = asyncio.run(one(laya_engine, prompt, SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True), cancel_after=3))
    assert cancelled.finish is FinishReason.CANCELLED and len(cancelled.tokens) < 200
    idle(laya_engine)
    after = run(laya_engine, prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
    assert len(after.tokens) == 5  # and the replica serves on


def test_the_same_seed_gives_the_same_text_alone_and_in_a_batch(laya_engine: Engine) -> None:
    prompt = ids(laya_engine, TEXTS[1])
    seeded = {"max_tokens": 20, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    alone = run(laya_engine, prompt, **seeded)
    again = run(laya_engine, prompt, **seeded)
    crowd = together(laya_engine, (ids(laya_engine, TEXTS[0]), {"max_tokens": 12}),
                     (prompt, seeded), (prompt, {**seeded, "seed": 99}),
                     (ids(laya_engine, TEXTS[3]), {"max_tokens": 6, "temperature": 0.7}))
    assert alone.tokens == again.tokens == crowd[1].tokens
    idle(laya_engine)


def test_the_allowed_token_mask_is_honoured(laya_engine: Engine) -> None:
    assert laya_engine.info is not None
    vocab = laya_engine.info.vocab_size
    allowed = sorted(set(ids(laya_engine, " yes no maybe")[-3:]) | {vocab - 1})
    mask = AllowedTokens.of(allowed, vocab)

    def constraint(generated: Sequence[int]) -> AllowedTokens:
        return mask

    for temperature in (0.0, 1.0):
        out = asyncio.run(one(laya_engine, ids(laya_engine, TEXTS[1]), SamplingParams(
            max_tokens=12, temperature=temperature, seed=5, ignore_eos=True), constraint))
        assert out.tokens and set(out.tokens) <= set(allowed), (temperature, out.tokens)
    idle(laya_engine)


def test_a_json_schema_constraint_yields_json_that_validates(laya_engine: Engine) -> None:
    """Structured output through the core's compiler on this backend's vocabulary: greedy
    and sampled, the output parses and has the schema's shape, or was cut by max_tokens."""
    from laya_core.structured import formats
    from laya_core.structured.compiler import GrammarCompiler

    assert laya_engine.tokenizer is not None and laya_engine.info is not None
    compiler = GrammarCompiler(laya_engine.tokenizer, laya_engine.info)
    spec = formats.json_schema({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
        "required": ["answer", "count"], "additionalProperties": False}, "schema")
    for temperature, seed in ((0.0, None), (1.0, 3)):
        out = asyncio.run(one(laya_engine, ids(laya_engine, TEXTS[1]), SamplingParams(
            max_tokens=40, temperature=temperature, seed=seed), compiler.constraint(spec)))
        if out.finish is FinishReason.LENGTH:
            assert out.text.startswith("{"), out.text
            continue
        assert out.finish is FinishReason.STOP, (out.finish, out.text)
        value = json.loads(out.text)
        assert value["answer"] in ("yes", "no") and isinstance(value["count"], int), value
    idle(laya_engine)


def test_stop_strings_stop_tokens_and_max_tokens_are_honoured(laya_engine: Engine) -> None:
    prompt = ids(laya_engine, TEXTS[0])
    free = run(laya_engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert free.finish is FinishReason.LENGTH and len(free.tokens) == 24
    text = free.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip())
    stopped = run(laya_engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True,
                  stop=(stop,))
    assert stopped.finish is FinishReason.STOP
    assert stopped.text == text[:text.index(stop)], (stop, stopped.text)
    token = free.tokens[6]
    by_token = run(laya_engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True,
                   stop_token_ids=(token,))
    assert by_token.finish is FinishReason.STOP
    assert by_token.tokens == free.tokens[:free.tokens.index(token) + 1]
    short = run(laya_engine, prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
    assert short.finish is FinishReason.LENGTH and short.tokens == free.tokens[:5]
    idle(laya_engine)


@pytest.mark.parametrize("text", TEXTS[3:])
def test_incremental_detokenization_never_splits_a_character(laya_engine: Engine,
                                                             text: str) -> None:
    """Streamed pieces are whole characters: they add up to the decoded tokens, and none
    holds a replacement character the whole text does not."""
    assert laya_engine.tokenizer is not None
    out = run(laya_engine, ids(laya_engine, f"Repeat after me: {text} {text}"),
              max_tokens=40, temperature=0.0, ignore_eos=True)
    whole = laya_engine.tokenizer.decode(list(out.tokens))
    assert out.text == whole
    if "\ufffd" not in whole:
        assert not [piece for piece in out.texts if "\ufffd" in piece]
    idle(laya_engine)


def test_no_kv_leaks_after_many_sequences(laya_engine: Engine) -> None:
    async def go() -> list[Run]:
        runs = []
        for wave in range(6):
            runs += await asyncio.gather(*(one(
                laya_engine, ids(laya_engine, f"{TEXTS[i % len(TEXTS)]} {wave}"),
                SamplingParams(max_tokens=1 + (i * 5 + wave) % 11, temperature=0.8,
                               ignore_eos=True),
                cancel_after=2 if i == 3 else None) for i in range(6)))
        return runs

    runs = asyncio.run(go())
    assert len(runs) == 36 and all(r.finish in (FinishReason.LENGTH, FinishReason.CANCELLED)
                                   for r in runs)
    idle(laya_engine)
    # A sequence of the full max_seq_len still fits: nothing was lost to leaked blocks.
    prompt = ids(laya_engine, LONG)
    room = laya_engine.config.max_seq_len - len(prompt)  # type: ignore[operator]
    full = run(laya_engine, prompt, max_tokens=room, temperature=0.0, ignore_eos=True)
    assert len(full.tokens) == room
    idle(laya_engine)


# Where a backend computes a row of a several-row batch (a draft's check) in other kernels
# than a one-row decode, the low digits differ and two tokens this close in
# log-probability may change places. A replica whose /ready says ``batch_invariant`` has no
# such excuse: its rows are the same bits in any batch.
NEAR_TIE = 0.25


def _agrees(got: Run, want: Run, exact: bool = False) -> bool:
    """The same tokens; or, unless ``exact``, they differ first where ``want``'s two
    likeliest tokens were a near-tie, and ``got`` took the other one."""
    at = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False))
               if a != b), None)
    if got.tokens == want.tokens or at is None or exact:
        return got.tokens == want.tokens
    top = want.samples[at].top
    return len(top) >= 2 and top[0][1] - top[1][1] < NEAR_TIE and \
        {got.tokens[at], want.tokens[at]} == {top[0][0], top[1][0]}


def _exact(engine: Engine) -> bool:
    """Whether the replica says its rows are the same bits in any batch (/ready)."""
    return bool(engine.runtime().get("batch_invariant"))


def test_speculative_decoding_gives_the_tokens_of_a_plain_run(
        laya_engine: Engine, laya_speculative_engine: Engine) -> None:
    """Drafts (prompt lookup) checked by the backend change no token: greedy output, alone
    and beside others, is the replica's without drafts (token for token where the replica says
    ``batch_invariant``, else up to a near-tie, above), and seeded
    output draws alike (one draw per output token either way); and the backend kept some
    drafts and refused others, so both of its paths ran (a refused draft's KV must be gone,
    or the tokens after it would differ)."""
    spec = laya_speculative_engine
    copy = f"{LONG[:100]} Again: {LONG[:60]}"
    prompts = [ids(spec, copy), ids(spec, "1, 2, 3, 1, 2, 3, 1, 2,"), ids(spec, TEXTS[0])]
    greedy = [(p, {"max_tokens": 32, "temperature": 0.0, "logprobs": 2}) for p in prompts]
    seeded = [(p, {"max_tokens": 32, "temperature": 0.9, "seed": 11 + i})
              for i, p in enumerate(prompts)]
    exact = _exact(laya_engine)
    for prompt, params in greedy:
        assert _agrees(run(spec, prompt, **params), run(laya_engine, prompt, **params), exact)
    got, want = together(spec, *greedy), together(laya_engine, *greedy)
    assert all(_agrees(g, w, exact) for g, w in zip(got, want, strict=True))
    got, want = together(spec, *seeded), together(laya_engine, *seeded)
    matches = sum(g.tokens == w.tokens for g, w in zip(got, want, strict=True))
    assert matches == len(seeded) if exact else matches >= len(seeded) - 1
    stats = spec.speculative
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    idle(spec)


def test_drafts_under_an_output_constraint_keep_its_tokens(
        laya_engine: Engine, laya_speculative_engine: Engine) -> None:
    """Drafts under an output constraint (``StepItem.draft_allowed``): each checked row
    samples under its own mask. The list below is copied from the prompt until the pattern
    asks for a comma where the prompt has a period: the draft is cut before the period, and
    the row after "date" must be sampled under its mask (the model, left alone, says the
    period). The output is the pattern's and the plain replica's (up to a near-tie), and
    drafts were kept (a model that says the one text a pattern allows says what the prompt
    holds). Then a JSON schema the output copies from the prompt, where what is kept depends
    on the model: the output is the plain replica's, and JSON of the schema where it ends."""
    from laya_core.structured import formats
    from laya_core.structured.compiler import GrammarCompiler

    spec = laya_speculative_engine
    assert spec.tokenizer is not None and spec.info is not None
    compiler = GrammarCompiler(spec.tokenizer, spec.info)
    listed = " banana, cherry, date, fig, grape."
    record = ('{"name": "the lighthouse keeper", "steps": ["climb the stairs", "light the '
              'lamp", "wind the clock", "watch the sea", "write the log"]}')
    cases = [
        (formats.regex(listed.replace(".", "\\."), "pattern"),
         "The list: apple, banana, cherry, date. The list again: apple,"),
        (formats.json_schema({"type": "object", "properties": {
            "name": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "steps"], "additionalProperties": False}, "schema"),
         f"Copy this JSON exactly.\n{record}\nThe copy:\n")]
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=2)
    for constraint, text in cases:
        before = attrs.evolve(spec.speculative)
        got = asyncio.run(one(spec, ids(spec, text), params, compiler.constraint(constraint)))
        want = asyncio.run(one(laya_engine, ids(laya_engine, text), params,
                               compiler.constraint(constraint)))
        assert _agrees(got, want, _exact(laya_engine)), (text, got.texts, want.texts)
        if constraint.kind == "regex":
            assert "".join(got.texts) == listed and got.finish is FinishReason.STOP
            kept = spec.speculative.num_accepted_tokens - before.num_accepted_tokens
            assert kept > 0, "no draft token was kept under the pattern"
        elif got.finish is FinishReason.STOP:
            assert set(json.loads("".join(got.texts))) == {"name", "steps"}, got.texts
    idle(spec)


def test_lora_adapters_apply_per_sequence_and_keep_their_kv_apart(
        laya_engine: Engine, laya_lora_engine: Engine) -> None:
    """Three adapters of random matrices (``laya_lora_engine``): ``zero`` (B = 0) answers
    as the base model; ``a`` and ``b`` answer otherwise; a batch mixing the base
    model and the three gives each sequence what it gets alone; and a prompt cached under
    one of them gives the others nothing from the prefix cache."""
    lora = laya_lora_engine
    prompts = [ids(lora, t) for t in (LONG, TEXTS[0], TEXTS[1])]
    greedy = {"max_tokens": 16, "temperature": 0.0, "logprobs": 2}
    for prompt in prompts:
        assert _agrees(run(lora, prompt, lora="zero", **greedy), run(laya_engine, prompt,
                                                                     **greedy))
    base = [run(lora, p, **greedy).tokens for p in prompts]
    changed = [run(lora, p, lora="a", **greedy).tokens for p in prompts]
    assert base != changed, "adapter 'a' changed no token of three prompts"
    mixed = [(p, {**greedy, "lora": name}) for p in prompts[1:]
             for name in (None, "a", "b", "zero")]
    alone = [run(lora, p, **params) for p, params in mixed]
    got = together(lora, *mixed)
    assert all(_agrees(g, w) for g, w in zip(got, alone, strict=True))
    canary = ids(lora, (TEXTS[3] + " ") * 4)  # a prompt none of them has seen
    first = {}
    for name in (None, "a", "b", "zero"):
        before = lora.prefix_tokens_reused
        first[name] = run(lora, canary, lora=name, **greedy)
        assert lora.prefix_tokens_reused == before, f"{name!r} was given another's KV"
    for name in ("a", None):  # a second run finds its own, and answers alike
        assert _agrees(run(lora, canary, lora=name, **greedy), first[name])
    idle(lora)


def test_the_suite_ran_on_a_real_model_file(laya_engine: Engine) -> None:
    path = laya_engine.config.path
    assert Path(path).exists(), path


# -- every backend, through the EngineClient the HTTP side talks to ----------------------------


@attrs.frozen
class ClientRun:
    texts: tuple[str, ...]
    finish: FinishReason
    usage: Usage
    timing: Any

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def ask(client: EngineClient, text: str, params: SamplingParams,
              constraint: Any = None, cancel_after_text: bool = False) -> ClientRun:
    prompt = client.tokenizer().encode(text, add_special=True)
    stream = await client.submit(prompt, params, constraint)
    assert await stream.wait_admitted() is None
    texts: list[str] = []
    async for event in stream:
        texts.append(event.text)
        if cancel_after_text and event.text:
            stream.cancel()
        if event.finish_reason is not None:
            assert event.usage is not None, event
            return ClientRun(tuple(texts), event.finish_reason, event.usage, event.timing)
    raise AssertionError("the stream ended without a finish reason")


def served(client: EngineClient) -> None:
    """The replica is up and runs nothing."""
    state = client.state()
    assert state.ready and state.num_running == 0, state


def test_a_request_streams_its_text_and_ends_with_its_usage_and_timing(
        laya_client: EngineClient) -> None:
    out = asyncio.run(ask(laya_client, TEXTS[1], SamplingParams(max_tokens=8,
                                                                  temperature=0.0)))
    assert out.finish in (FinishReason.STOP, FinishReason.LENGTH) and out.text, out
    assert out.usage.prompt_tokens > 0 and 1 <= out.usage.completion_tokens <= 8, out.usage
    assert out.timing is not None
    served(laya_client)


def test_max_tokens_and_the_length_rule_hold(laya_client: EngineClient) -> None:
    out = asyncio.run(ask(laya_client, TEXTS[0], SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True)))
    assert out.finish is FinishReason.LENGTH and out.usage.completion_tokens == 5, out
    limit = laya_client.info().max_seq_len
    with pytest.raises(RequestTooLongError):
        asyncio.run(ask(laya_client, TEXTS[0], SamplingParams(max_tokens=limit)))
    served(laya_client)


def test_a_cancelled_request_ends_and_its_replica_serves_on(laya_client: EngineClient) -> None:
    out = asyncio.run(ask(laya_client, TEXTS[1], SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True), cancel_after_text=True))
    assert out.finish is FinishReason.CANCELLED and out.usage.completion_tokens < 200, out
    served(laya_client)
    after = asyncio.run(ask(laya_client, TEXTS[1], SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True)))
    assert after.usage.completion_tokens == 3


def test_a_json_schema_is_honoured_or_refused_naming_its_field(
        laya_client: EngineClient) -> None:
    """A backend applies structured output (the output parses and has the schema's shape,
    or max_tokens cut it), or refuses it with an error naming the request's field."""
    from laya_core.structured import formats

    spec = formats.json_schema({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
        "additionalProperties": False}, "response_format")
    try:
        out = asyncio.run(ask(laya_client, TEXTS[1], SamplingParams(
            max_tokens=40, temperature=0.0), spec))
    except (UnsupportedParameterError, GrammarError) as e:
        assert e.param == "response_format", e
    else:
        if out.finish is FinishReason.LENGTH:
            assert out.text.lstrip().startswith("{"), out.text
        else:
            assert out.finish is FinishReason.STOP, out
            assert json.loads(out.text)["answer"] in ("yes", "no"), out.text
    served(laya_client)



def test_stop_strings_seeds_and_whole_characters_hold_through_the_client(
        laya_client: EngineClient) -> None:
    """What a backend's own engine must honour too: a stop string ends the text before it,
    the same seed gives the same text, and streamed pieces are whole characters."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = asyncio.run(ask(laya_client, TEXTS[0], greedy))
    text = free.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip())
    stopped = asyncio.run(ask(laya_client, TEXTS[0], attrs.evolve(greedy, stop=(stop,))))
    assert stopped.finish is FinishReason.STOP, stopped
    assert stopped.text == text[:text.index(stop)], (stop, stopped.text, text)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True)
    first = asyncio.run(ask(laya_client, TEXTS[1], seeded))
    assert asyncio.run(ask(laya_client, TEXTS[1], seeded)).text == first.text
    pieces = asyncio.run(ask(laya_client, f"Repeat after me: {TEXTS[4]}", attrs.evolve(
        greedy, max_tokens=40)))
    if "\ufffd" not in pieces.text:
        assert not [p for p in pieces.texts if "\ufffd" in p], pieces.texts
    served(laya_client)
