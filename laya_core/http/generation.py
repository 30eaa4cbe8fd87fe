"""From a validated request to running sequences, and from their events to results."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from laya_core.engine.limits import room_to_generate
from laya_core.engine.stream import GenerationStream
from laya_core.http.completion_requests import ChatRequest, CompletionRequest, GenerationRequest
from laya_core.http.errors import QUEUE_RETRY_AFTER_S, APIError, invalid, refusal
from laya_core.http.replicas import ready_client, route
from laya_core.http.thinking import Thinking, thinking_of
from laya_core.kv.hashing import cache_salt, prefix_hashes
from laya_core.replica.client import EngineClient, RequestTooLongError
from laya_core.serving.deployment import Deployment
from laya_core.serving.template_sandbox import TemplateUnavailableError
from laya_core.structured.markup import shown
from laya_core.structured.reasoning import ReasoningParser
from laya_core.structured.spec import GrammarError
from laya_core.structured.tool_parsers import CallParser
from laya_core.structured.tools import call_grammar
from laya_core.types import FinishReason, Sample, SamplingParams, Timing, TokenEvent


@attrs.define
class Running:
    """One submitted sequence: its stream, where it runs, and how long routing took."""

    stream: GenerationStream
    client: EngineClient
    route_s: float
    deployment: Deployment
    prompt_token_ids: Sequence[int]  # the HTTP side's own list (the engine copies it)
    prompt_text: str | None = None  # for echo
    released: bool = False
    # Echo with max_tokens 0: the one token generated (to score the prompt) is not shown.
    discard_output: bool = False
    # A reasoning model's chat: where its reasoning starts and its budget (None: no split).
    thinking: Thinking | None = None

    # The first parser made for the output (the stream's, or collect's), fed event by event:
    # it counts the reasoning's tokens for the usage object.
    counting: ReasoningParser | None = None

    def reasoning_parser(self) -> ReasoningParser | None:
        """A parser of this choice's reasoning and answer; None when the model has none."""
        if self.thinking is None:
            return None
        parser = self.thinking.parser()
        if self.counting is None:
            self.counting = parser
        return parser

    def head_of(self, token_ids: Sequence[int]) -> Callable[[int], str]:
        """``head(n)``, the text of the first n of ``token_ids`` (one event's), for a
        reasoning parser's ``feed``: where a thinking budget ends inside an event."""
        return lambda n: self.client.tokenizer().decode(list(token_ids[:n]))

    @property
    def reasoning_tokens(self) -> int:
        return self.counting.reasoning_tokens if self.counting is not None else 0

    def release(self) -> None:
        """Cancel the sequence if still running and give the router its count back, once."""
        if not self.released:
            self.released = True
            self.stream.cancel()
            self.deployment.router.release(self.client.replica_id)


@attrs.define
class Result:
    """A finished sequence, gathered."""

    text: str
    finish: FinishReason
    timing: Timing | None
    token_ids: list[int]
    samples: list[Sample]
    prompt_logprobs: list[Sample] = attrs.field(factory=list)  # from the prompt's second token


def _params(req: GenerationRequest, max_tokens: int, choice: int,
            prompt_logprobs: int | None,
            shown: tuple[tuple[int, str], ...] = ()) -> SamplingParams:
    seed = None if req.seed is None else req.seed + choice  # n choices must differ
    return SamplingParams(shown_tokens=shown,
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logprobs=req.logprobs, prompt_logprobs=prompt_logprobs, priority=req.priority or 0,
        speculative=req.speculative, lora=req.lora)


def prompt_top(request: ChatRequest | CompletionRequest) -> int | None:
    """Alternatives per prompt token to compute, or None: ``prompt_logprobs``, and for an
    echoed completion with ``logprobs`` those too (the echoed prompt is scored, as vLLM does)."""
    req = request.common
    echoed = req.logprobs if isinstance(request, CompletionRequest) and request.echo else None
    wanted = [k for k in (req.prompt_logprobs, echoed) if k is not None]
    return max(wanted) if wanted else None


def _check_prompt_logprobs(request: ChatRequest | CompletionRequest,
                           client: EngineClient) -> None:
    info = client.info()
    if prompt_top(request) is not None and not info.supports_prompt_logprobs:
        param = "prompt_logprobs" if request.common.prompt_logprobs is not None else "logprobs"
        raise invalid(param, f"the {info.backend_name} backend of {request.common.model!r} "
                      "cannot compute prompt log-probabilities", "unsupported_parameter")


def chat_ids(deployment: Deployment, client: EngineClient, request: ChatRequest) -> list[int]:
    """A chat request's prompt: the template's rendering, and with ``continue_final`` the
    turn so far and then the text of the final (assistant) message, which the model
    continues (as text: no control tokens). Blocking: call it from a worker thread."""
    variables = request.template_vars
    if not request.continue_final:
        return deployment.chat_prompt(client, request.messages, tools=request.tools,
                                      variables=variables)
    *before, last = request.messages
    ids = deployment.chat_prompt(client, before, tools=request.tools, variables=variables)
    return ids + client.tokenizer().encode(last["content"], add_special=False,
                                           parse_special=False)


def _prompts(deployment: Deployment, request: ChatRequest | CompletionRequest,
             client: EngineClient) -> list[tuple[list[int], str | None]]:
    """Token ids of each prompt, with its text (for echo). Blocking: rendering a chat
    template and tokenizing megabytes take time, so ``start`` runs this on a worker thread."""
    if isinstance(request, ChatRequest):
        try:
            return [(chat_ids(deployment, client, request), None)]
        except TemplateUnavailableError as e:  # the renderer, not the template: retry
            raise APIError(503, str(e), code="template_unavailable",
                           retry_after=QUEUE_RETRY_AFTER_S) from None
    out: list[tuple[list[int], str | None]] = []
    tokenizer = client.tokenizer()
    for i, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, tuple):
            bad = tokenizer.first_unknown(prompt)
            if bad is not None:
                raise invalid(param, f"token id {bad} is outside the vocabulary "
                              f"(0..{tokenizer.vocab_size - 1})")
            out.append((list(prompt), tokenizer.decode(prompt)))
        else:
            out.append((tokenizer.encode(prompt, add_special=True), prompt))
    return out


async def _submit(deployment: Deployment, req: GenerationRequest, prompt: list[int],
                  params: SamplingParams, text: str | None, session: str | None,
                  discard_output: bool = False) -> Running:
    t0 = time.perf_counter()
    # Hashing the prompt's leading blocks is routing work, so it counts in the route time.
    prefix = prefix_hashes(prompt, deployment.block_sizes[req.model],
                           salt=cache_salt(req.lora)) \
        if deployment.models[req.model].routing == "prefix" else ()
    replica, route_s = route(deployment, req.model, session, prefix, t0)
    client = deployment.clients[replica]
    try:
        stream = await client.submit(prompt, params, req.constraint)
    except BaseException as e:
        deployment.router.release(replica)
        if isinstance(e, RequestTooLongError):
            deployment.rejections[req.model, "too_long"] += 1
        if (error := refusal(e, req.max_tokens_param)) is None:
            raise
        raise error from None
    return Running(stream, client, route_s, deployment, prompt, text,
                   discard_output=discard_output)


async def _admitted(run: Running) -> None:
    early = await run.stream.wait_admitted()
    if early is None:
        return
    if early.finish_reason is FinishReason.REJECTED and run.client.info().max_queue == 0:
        raise APIError(429, f"{early.error}; retry later", code="queue_full",
                       retry_after=QUEUE_RETRY_AFTER_S)
    if early.finish_reason is FinishReason.REJECTED:
        raise APIError(503, f"no room for this request: {early.error}; retry later",
                       code="queue_timeout", retry_after=QUEUE_RETRY_AFTER_S)
    raise APIError(503, f"the request ended before it ran: {early.error or 'shutting down'}",
                   code="not_run", retry_after=QUEUE_RETRY_AFTER_S)


async def start(deployment: Deployment, request: ChatRequest | CompletionRequest,
                session: str | None = None) -> list[Running]:
    """Validate against the model, route, submit every choice and wait until all run.

    Raises :class:`APIError`: 400 for what can never fit, 429 when a queue is full, 503 when
    the wait for room timed out. Waiting happens before any response byte, so a streamed
    request can still get a proper status. On any error nothing is left running. ``session``
    (the X-Session-ID header) defaults to the request's ``user``.
    """
    if (base := deployment.lora.parents.get(request.common.model)) is not None:
        # A LoRA adapter's name: its base model runs the request, with the adapter.
        request = attrs.evolve(request, common=attrs.evolve(
            request.common, model=base, lora=request.common.model))
    async with ready_client(deployment, request.common.model) as (client, load_s):
        return await _start(deployment, request, session or request.common.user, client,
                            load_s)


async def _start(deployment: Deployment, request: ChatRequest | CompletionRequest,
                 session: str | None, client: EngineClient, load_s: float) -> list[Running]:
    req = request.common
    _check_prompt_logprobs(request, client)
    if isinstance(request, ChatRequest) and request.tools is not None \
            and deployment.tool_format(client).name != "hermes":
        req = await asyncio.to_thread(_in_model_format, deployment, request, client)
    prompts = await asyncio.to_thread(_prompts, deployment, request, client)
    thinking = None
    form = deployment.reasoning_format(client) if isinstance(request, ChatRequest) else "none"
    if isinstance(request, ChatRequest) and form != "none":
        thinking = thinking_of(deployment, request, client, prompts[0][0], form)
        if thinking.grammar_needed(req.constraint):
            req = attrs.evolve(req, constraint=thinking.wrap(req.constraint))
    shown = _shown_markup(deployment, request, client, thinking)
    param = "messages" if isinstance(request, ChatRequest) else "prompt"
    limit = client.info().max_seq_len
    runs: list[Running] = []
    try:
        for prompt, text in prompts:
            if not prompt:
                raise invalid(param, "the prompt holds no tokens once tokenized; send text "
                              "the model can read", "empty_prompt")
            room = room_to_generate(len(prompt), limit)
            if room < 1:
                deployment.rejections[req.model, "too_long"] += 1
                raise invalid(param, f"the prompt has {len(prompt)} tokens; this model's "
                              f"max_seq_len is {limit}, which leaves no room to generate",
                              "context_length_exceeded")
            # A max_tokens that does not fit is refused by the client's submit (the same rule).
            max_tokens = req.max_tokens if req.max_tokens is not None else room
            for choice in range(req.n):
                # The first choice scores the prompt for all n (they share it); echo with
                # max_tokens 0 generates one token, which is not shown (as vLLM does).
                params = _params(req, max(max_tokens, 1), choice,
                                 prompt_top(request) if choice == 0 else None, shown)
                runs.append(await _submit(deployment, req, prompt, params, text, session,
                                          discard_output=max_tokens == 0))
        for run in runs:
            run.thinking = thinking
            await _admitted(run)
            if load_s:  # the model loaded for it: queue time, and a layer of its own
                run.stream.waits_before.append(("load", load_s))
    except BaseException:  # an error, or cancelled while queued: leave nothing behind
        release_all(runs)
        raise
    return runs


def _shown_markup(deployment: Deployment, request: ChatRequest | CompletionRequest,
                  client: EngineClient, thinking: Thinking | None,
                  ) -> tuple[tuple[int, str], ...]:
    """The control tokens a chat's output shows for its parsers: its tool-call format's
    markup with tools, gpt-oss's channels with a harmony model (structured/markup.py)."""
    if not isinstance(request, ChatRequest):
        return ()
    controls = deployment.tool_format(client).controls if request.tools is not None else ()
    if thinking is not None:
        controls += thinking.controls
    return shown(tuple(dict.fromkeys(controls)))


def _in_model_format(deployment: Deployment, request: ChatRequest,
                     client: EngineClient) -> GenerationRequest:
    """The request with its calls constrained in the model's own format (parsing built
    them in Hermes', not knowing the model). Blocking: a worker thread's."""
    req = request.common
    assert request.tools is not None and req.constraint is not None
    answer = req.constraint.parts[1] if req.constraint.kind == "tools_or_json" else None
    try:
        constraint = call_grammar(request.tools, answer=answer,
                                  fmt=deployment.tool_format(client))
    except GrammarError as e:
        raise invalid(e.param, str(e)) from None
    return attrs.evolve(req, constraint=constraint)


def tool_parser(run: Running, request: ChatRequest) -> CallParser | None:
    """A parser of one choice's tool calls, in its model's format; None without tools."""
    if request.tools is None:
        return None
    answer = request.common.constraint is not None \
        and request.common.constraint.kind == "tools_or_json"
    return run.deployment.tool_format(run.client).parser(request.tools, answer)


def release_all(runs: Sequence[Running]) -> None:
    for run in runs:
        run.release()


def engine_error(event: TokenEvent) -> APIError:
    """What an ERROR finish tells the client: a 503 to retry where the replica went away
    (a worker process died), else a 500."""
    if event.replica_lost:
        return APIError(503, f"{event.error}", code="replica_lost",
                        retry_after=QUEUE_RETRY_AFTER_S)
    return APIError(500, f"generation failed: {event.error}", code="engine_error")


async def collect(run: Running) -> Result:
    """Wait for the whole output of one sequence."""
    parts: list[str] = []
    tokens: list[int] = []
    samples: list[Sample] = []
    prompt: list[Sample] = []
    counting = run.reasoning_parser() if run.counting is None else None
    async for event in run.stream:
        if counting is not None:
            counting.feed(event.text, len(event.token_ids), run.head_of(event.token_ids))
        parts.append(event.text)
        tokens += event.token_ids
        samples += event.samples
        prompt += event.prompt_logprobs
        if event.finish_reason is FinishReason.ERROR:
            raise engine_error(event)
        if event.finish_reason is not None:
            if run.discard_output:
                return Result("", FinishReason.LENGTH, event.timing, [], [], prompt)
            return Result("".join(parts), event.finish_reason, event.timing, tokens, samples,
                          prompt)
    raise RuntimeError("the stream ended without a finish reason")


async def merged(runs: Sequence[Running]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several sequences as they come, tagged with the sequence's index."""
    if len(runs) == 1:
        async for event in runs[0].stream:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    async def pump(i: int, run: Running) -> None:
        async for event in run.stream:
            await queue.put((i, event))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, event = await queue.get()
            remaining -= event.finish_reason is not None
            yield i, event
    finally:
        for task in tasks:
            task.cancel()


def combined_timing(results: Sequence[Timing | None]) -> Timing | None:
    """The slowest of each layer over the request's sequences."""
    timings = [t for t in results if t is not None]
    if not timings:
        return None
    layers: dict[str, float] = {}
    for t in timings:
        for name, seconds in t.layers:
            layers[name] = max(layers.get(name, 0.0), seconds)
    return Timing(max(t.queue_s for t in timings), max(t.prefill_s for t in timings),
                  max(t.decode_s for t in timings), layers=tuple(layers.items()),
                  draft_tokens=sum(t.draft_tokens for t in timings),
                  accepted_tokens=sum(t.accepted_tokens for t in timings))


def server_timing(route_s: float, timing: Timing | None) -> str:
    """The ``Server-Timing`` header value, durations in milliseconds."""
    parts = [("route", route_s)]
    if timing is not None:
        parts += [("queue", timing.queue_s), ("prefill", timing.prefill_s),
                  ("decode", timing.decode_s), *timing.layers]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in parts)


def timing_object(route_s: float, timing: Timing | None) -> dict[str, float]:
    """The ``laya_timing`` object; with speculative decoding, its draft tokens checked and
    kept too (kept over checked: the request's acceptance rate)."""
    t = timing or Timing(0.0, 0.0, 0.0)
    spec = {"spec_draft_tokens": t.draft_tokens, "spec_accepted_tokens": t.accepted_tokens} \
        if t.draft_tokens else {}
    return {"route_ms": route_s * 1000, "queue_ms": t.queue_s * 1000,
            "prefill_ms": t.prefill_s * 1000, "decode_ms": t.decode_s * 1000,
            **{f"{name}_ms": seconds * 1000 for name, seconds in t.layers}, **spec}


def usage(runs: Sequence[Running], n: int) -> dict[str, Any]:
    """OpenAI's usage object: prompt tokens once per prompt (runs come n per prompt), of
    which those served from the prefix cache; completion tokens of all."""
    firsts = [r.stream.usage for r in runs[::n]]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(r.stream.usage.completion_tokens for r in runs if not r.discard_output)
    out: dict[str, Any] = {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)}}
    if any(r.thinking is not None for r in runs):  # a reasoning model's: its reasoning
        out["completion_tokens_details"] = {
            "reasoning_tokens": sum(r.reasoning_tokens for r in runs if not r.discard_output)}
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
