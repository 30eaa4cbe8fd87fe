"""From a validated request to a running sequence, and from its events to OpenAI responses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from laya_core.deployment import Deployment, UnknownModelError
from laya_core.engine import Engine, GenerationStream, QueueFullError, RequestTooLongError
from laya_core.http.errors import APIError, invalid
from laya_core.http.requests import ChatRequest, CompletionRequest, GenerationRequest
from laya_core.router import NoRouteError
from laya_core.types import FinishReason, SamplingParams, Timing, TokenEvent


QUEUE_RETRY_AFTER_S = 2


@attrs.define
class Running:
    """A submitted request: its stream, where it runs, and how long routing took."""

    stream: GenerationStream
    engine: Engine
    route_s: float
    deployment: Deployment
    released: bool = False

    def release(self) -> None:
        """Cancel the sequence if still running and give the router its count back, once."""
        if not self.released:
            self.released = True
            self.stream.cancel()
            self.deployment.router.release(self.engine.replica_id)


def _params(req: GenerationRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop)


def _prompt_ids(deployment: Deployment, request: ChatRequest | CompletionRequest) -> list[int]:
    model = request.common.model
    engine = deployment.any_engine(model)
    if isinstance(request, ChatRequest):
        text = deployment.chat_template(model).render(request.messages)
        return engine.backend.tokenize(text, add_special=True)
    if isinstance(request.prompt, list):
        vocab = engine.info.vocab_size  # type: ignore[union-attr]
        bad = next((t for t in request.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return list(request.prompt)
    return engine.backend.tokenize(request.prompt, add_special=True)


async def start(deployment: Deployment, request: ChatRequest | CompletionRequest) -> Running:
    """Validate against the model, route, submit and wait for a place in the batch.

    Raises :class:`APIError`: 400 for what can never fit, 429 when the queue is full, 503 when
    the wait for room timed out. Waiting happens before any response byte, so a streamed
    request can still get a proper status.
    """
    req = request.common
    try:
        deployment.model(req.model)
    except UnknownModelError:
        raise APIError(404, f"the model {req.model!r} does not exist; see GET /v1/models",
                       param="model", code="model_not_found") from None
    if not deployment.ready:
        raise APIError(503, "the model is still loading", code="not_ready", retry_after=5)
    prompt = _prompt_ids(deployment, request)
    param = "messages" if isinstance(request, ChatRequest) else "prompt"
    limit = deployment.any_engine(req.model).max_seq_len
    if len(prompt) >= limit:
        deployment.rejections[req.model, "too_long"] += 1
        raise invalid(param, f"the prompt has {len(prompt)} tokens; this model's max_seq_len "
                      f"is {limit}, which leaves no room to generate", "context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(prompt)
    t0 = time.perf_counter()
    try:
        replica = deployment.router.route(req.model, req.user)
    except NoRouteError as e:
        raise APIError(503, str(e), code="no_replica", retry_after=5) from None
    route_s = time.perf_counter() - t0
    engine = deployment.engines[replica]
    try:
        stream = engine.submit(prompt, _params(req, max_tokens))
    except RequestTooLongError as e:
        deployment.rejections[req.model, "too_long"] += 1
        deployment.router.release(replica)
        raise invalid("max_tokens", str(e), "context_length_exceeded") from None
    except QueueFullError as e:
        deployment.router.release(replica)
        raise APIError(429, str(e), code="queue_full", retry_after=QUEUE_RETRY_AFTER_S) from None
    except Exception:
        deployment.router.release(replica)
        raise
    run = Running(stream, engine, route_s, deployment)
    try:
        early = await stream.wait_admitted()
    except BaseException:  # cancelled while queued: leave the queue
        run.release()
        raise
    if early is not None:
        run.release()
        if early.finish_reason is FinishReason.REJECTED:
            raise APIError(503, f"no room for this request: {early.error}; retry later",
                           code="queue_timeout", retry_after=QUEUE_RETRY_AFTER_S)
        raise APIError(503, f"the request ended before it ran: {early.error or 'shutting down'}",
                       code="not_run", retry_after=QUEUE_RETRY_AFTER_S)
    return run


def server_timing(route_s: float, timing: Timing | None) -> str:
    """The ``Server-Timing`` header value, durations in milliseconds."""
    parts = [("route", route_s)]
    if timing is not None:
        parts += [("queue", timing.queue_s), ("prefill", timing.prefill_s),
                  ("decode", timing.decode_s)]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in parts)


def timing_object(route_s: float, timing: Timing | None) -> dict[str, float]:
    t = timing or Timing(0.0, 0.0, 0.0)
    return {"route_ms": route_s * 1000, "queue_ms": t.queue_s * 1000,
            "prefill_ms": t.prefill_s * 1000, "decode_ms": t.decode_s * 1000}


def usage(run: Running) -> dict[str, int]:
    prompt = run.stream.num_prompt_tokens
    completion = len(run.stream.seq.output_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _engine_error(event: TokenEvent) -> APIError:
    return APIError(500, f"generation failed: {event.error}", code="engine_error")


async def collect(run: Running) -> tuple[str, FinishReason, Timing | None]:
    """Wait for the whole output; the text, why it ended and the timing."""
    parts: list[str] = []
    async for event in run.stream:
        parts.append(event.text)
        if event.finish_reason is FinishReason.ERROR:
            raise _engine_error(event)
        if event.finish_reason is not None:
            return "".join(parts), event.finish_reason, event.timing
    raise RuntimeError("the stream ended without a finish reason")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def sse_events(run: Running, chunk: Callable[[str, str | None], dict[str, Any]],
                     include_usage: bool, usage_chunk: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events for a streamed response; ``chunk(text, finish)`` shapes each one."""
    try:
        async for event in run.stream:
            if event.finish_reason is FinishReason.ERROR:
                yield json.dumps(_engine_error(event).body())
                break
            finish = event.finish_reason.value if event.finish_reason else None
            if event.text or finish:
                body = chunk(event.text, finish)
                if finish:
                    body["laya_timing"] = timing_object(run.route_s, event.timing)
                yield json.dumps(body)
            if finish and include_usage:
                yield json.dumps({**usage_chunk, "choices": [], "usage": usage(run)})
        yield "[DONE]"
    finally:
        run.release()
