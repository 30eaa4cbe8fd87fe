"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.engine.layer_clock import HTTP, now_ns
from laya_core.http import access_log
from laya_core.http import generation as gen
from laya_core.http import openai_format as fmt
from laya_core.http.body import json_body
from laya_core.http.chat_requests import parse_chat
from laya_core.http.completion_requests import (
    ChatRequest,
    CompletionRequest,
    parse_completion,
    with_header_priority,
)
from laya_core.http.disconnect import until_disconnect
from laya_core.http.errors import invalid
from laya_core.http.observe import Observer
from laya_core.http.sse import SSEResponse
from laya_core.http.thinking import reasoning_of
from laya_core.serving.chat_template import TemplateError
from laya_core.serving.deployment import Deployment
from laya_core.structured.formats import CONSTRAINT_FIELDS
from laya_core.structured.tool_parsers import CallParser
from laya_core.types import FinishReason, Timing

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


def completion_routes(deployment: Deployment, observer: Observer) -> list[Route]:
    handlers = CompletionHandlers(deployment, observer)
    return [Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
            Route("/v1/completions", handlers.completions, methods=["POST"])]


async def _parsed(parse: Callable[[Any], T], body: Any) -> T:
    """``parse(body)``, on a worker thread when the body carries an output constraint or
    tools: checking those walks the client's schemas and grammars (up to 20,000 values, or
    256 KiB of text: tens of ms), which the event loop must not wait for."""
    if isinstance(body, dict) and any(body.get(k) is not None for k in CONSTRAINT_FIELDS):
        return await asyncio.to_thread(parse, body)
    return parse(body)


class CompletionHandlers:
    def __init__(self, deployment: Deployment, observer: Observer) -> None:
        self.deployment = deployment
        self.observer = observer
        self.server = deployment.manifest.server

    async def start(
        self, request: Request, req: ChatRequest | CompletionRequest, id_prefix: str, obj: str,
    ) -> tuple[list[gen.Running], dict[str, Any], Callable[[int], bytes]]:
        """Start the request's sequences (cancelled if the client leaves while they queue);
        the running sequences, the fields every response object repeats, and token bytes."""
        session = request.headers.get("x-session-id")
        req = with_header_priority(req, request.headers.get("x-priority"))
        try:
            runs = await until_disconnect(request, gen.start(self.deployment, req, session))
        except TemplateError as e:
            raise invalid("messages", str(e), "chat_template_error") from None
        base = {"id": gen.new_id(id_prefix), "object": obj, "created": int(time.time()),
                "model": req.common.model}
        return runs, base, runs[0].client.tokenizer().token_bytes

    async def chat(self, request: Request) -> Response:
        req = await _parsed(parse_chat, await json_body(request, self.server))
        runs, base, token_bytes = await self.start(request, req, "chatcmpl",
                                                    "chat.completion.chunk")
        if req.common.stream:
            started: set[int] = set()
            parsers = [gen.tool_parser(run, req) for run in runs] if req.tools else []
            thinkers = [run.reasoning_parser() for run in runs]

            def chunk(i: int, event: Any) -> dict[str, Any]:
                parser = parsers[i] if parsers else None
                text, reasoning = event.text, None
                if (thinker := thinkers[i]) is not None:  # the answer from its reasoning
                    last = event.finish_reason is not None
                    pieces = thinker.feed(text, len(event.token_ids),
                                          runs[i].head_of(event.token_ids)) + (
                        thinker.finish() if last else [])
                    reasoning = "".join(t for k, t in pieces if k == "reasoning") or None
                    text = "".join(t for k, t in pieces if k == "content")
                if parser is not None:  # the delta first: the last event's text may end a call
                    delta = tool_delta(parser, text, event.finish_reason is not None)
                    finish = _finish_reason(req, event.finish_reason, parser)
                else:
                    finish = event.finish_reason.value if event.finish_reason else None
                    delta = {"content": text}
                if reasoning is not None:  # vLLM's field for it
                    delta = {"reasoning_content": reasoning, **delta}
                    if not delta.get("content") and "tool_calls" not in delta:
                        delta.pop("content", None)
                if i not in started:
                    started.add(i)
                    delta = {"role": "assistant", **delta}
                lp = fmt.chat_logprobs(event.samples, token_bytes) if event.samples else None
                return {**base, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                             "finish_reason": finish}]}

            return self._stream(runs, req, chunk, base)
        results = await self.collect(request, runs, req)
        choices = []
        for i, r in enumerate(results):
            reasoning, answer = reasoning_of(runs[i], r)
            message: dict[str, Any] = {"role": "assistant", "content": answer}
            if reasoning is not None:
                message["reasoning_content"] = reasoning or None
            finish = r.finish.value
            parser = gen.tool_parser(runs[i], req)
            if parser is not None:
                content = "".join(text for kind, text in parser.feed(answer) + parser.finish()
                                  if kind == "content")
                message["content"] = content if content or not parser.calls else None
                if parser.calls:
                    message["tool_calls"] = parser.calls
                finish = _finish_reason(req, r.finish, parser) or finish
            choices.append({"index": i, "message": message,
                            "logprobs": fmt.chat_logprobs(r.samples, token_bytes)
                            if req.common.logprobs is not None else None,
                            "finish_reason": finish})
        body = {**base, "object": "chat.completion", "choices": choices}
        if req.common.prompt_logprobs is not None:  # vLLM's: once, beside the choices
            body["prompt_logprobs"] = fmt.prompt_logprobs(results[0].prompt_logprobs,
                                                          token_bytes, req.common.prompt_logprobs)
        return self._json(runs, req, results, body)

    async def completions(self, request: Request) -> Response:
        req = await _parsed(parse_completion, await json_body(request, self.server))
        runs, base, token_bytes = await self.start(request, req, "cmpl", "text_completion")
        if req.common.stream:
            def chunk(i: int, event: Any) -> dict[str, Any]:
                lp = fmt.completion_logprobs(event.samples, token_bytes) \
                    if event.samples else None
                finish = event.finish_reason.value if event.finish_reason else None
                return {**base, "choices": [{"index": i, "text": event.text, "logprobs": lp,
                                             "finish_reason": finish}]}

            return self._stream(runs, req, chunk, base)
        results = await self.collect(request, runs, req)
        n = req.common.n
        choices = [_completion_choice(req, i, run, r, results[i - i % n], token_bytes)
                   for i, (run, r) in enumerate(zip(runs, results, strict=True))]
        return self._json(runs, req, results, {**base, "choices": choices})

    async def collect(self, request: Request, runs: list[gen.Running],
                       req: ChatRequest | CompletionRequest) -> list[gen.Result]:
        try:
            return await until_disconnect(request, asyncio.gather(*map(gen.collect, runs)))
        finally:
            gen.release_all(runs)

    def _json(self, runs: list[gen.Running], req: ChatRequest | CompletionRequest,
              results: list[gen.Result], body: dict[str, Any]) -> Response:
        timings = [r.timing for r in results]
        body["usage"] = gen.usage(runs, req.common.n)
        self.finished(runs, req, timings, body["usage"])
        route_s, timing = max(r.route_s for r in runs), gen.combined_timing(timings)
        return JSONResponse(body, headers={"Server-Timing": gen.server_timing(route_s, timing)})

    def finished(self, runs: list[gen.Running], req: ChatRequest | CompletionRequest,
                  timings: list[Timing | None], usage: dict[str, Any],
                  error: str | None = None) -> None:
        """Observe a complete response (a failed one only for the access log)."""
        if error is None:
            self.observer.finished(req.common.model, runs, timings, req.common.n)
        access_log.note(req.common.model, usage, max(r.route_s for r in runs),
                        gen.combined_timing(timings), error)

    def _stream(self, runs: list[gen.Running], req: ChatRequest | CompletionRequest,
                chunk: Callable[[int, Any], dict[str, Any]], base: dict[str, Any]) -> Response:
        clock = runs[0].client.clock  # the http layer of the replica's tokens

        async def events() -> AsyncIterator[str]:
            timings: list[Timing | None] = [None] * len(runs)  # by choice, once finished
            error = None
            try:
                async for i, event in gen.merged(runs):
                    if event.finish_reason is FinishReason.ERROR:
                        failure = gen.engine_error(event)
                        yield json.dumps(failure.body())
                        error = failure.code
                        break
                    if event.text or event.finish_reason or event.samples:
                        start = now_ns()
                        body = chunk(i, event)
                        if event.finish_reason:
                            timings[i] = event.timing
                            body["laya_timing"] = gen.timing_object(runs[i].route_s,
                                                                    event.timing)
                        data = json.dumps(body)
                        clock.add(HTTP, start)
                        yield data
                usage = gen.usage(runs, req.common.n)
                if req.common.include_usage:
                    yield json.dumps({**base, "choices": [], "usage": usage})
                self.finished(runs, req, timings, usage, error)
                yield "[DONE]"
            finally:
                gen.release_all(runs)

        return SSEResponse(events(), clock=clock)  # type: ignore[return-value]


def _completion_choice(req: CompletionRequest, index: int, run: gen.Running, r: gen.Result,
                       first: gen.Result, token_bytes: Callable[[int], bytes],
                       ) -> dict[str, Any]:
    """One choice of a completion; ``first``, its prompt's first choice, scored the prompt."""
    prompt = first.prompt_logprobs
    echo = req.echo and run.prompt_text is not None
    text = (run.prompt_text or "") + r.text if echo else r.text
    top = req.common.logprobs
    lp = None
    if top is not None and echo:
        lp = fmt.echo_logprobs(run.prompt_token_ids[0], prompt, r.samples,
                               token_bytes, top)
    elif top is not None:
        lp = fmt.completion_logprobs(r.samples, token_bytes)
    choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": r.finish.value}
    wanted = req.common.prompt_logprobs
    if wanted is None and echo:
        wanted = top  # vLLM's: an echo with logprobs scores the prompt with as many
    if wanted is not None:
        choice["prompt_logprobs"] = fmt.prompt_logprobs(prompt, token_bytes, wanted)
    return choice


def _finish_reason(req: ChatRequest, finish: FinishReason | None,
                   parser: CallParser) -> str | None:
    """OpenAI's finish reason with tools: "tool_calls" when the output ended on complete
    calls, but "stop" for a named tool_choice (as OpenAI answers); "length" whatever was cut
    short, with the calls as far as they got."""
    if finish is None:
        return None
    if finish is FinishReason.STOP and parser.calls and parser.complete:
        return "stop" if req.tools is not None and req.tools.named else "tool_calls"
    return finish.value


def tool_delta(parser: CallParser, text: str, last: bool) -> dict[str, Any]:
    """One stream chunk's delta with tools: the content and tool-call pieces ``text``
    completes (a call's arguments fragments merged), and at the end what was held back."""
    pieces = parser.feed(text) + (parser.finish() if last else [])
    content = "".join(v for kind, v in pieces if kind == "content")
    calls: list[dict[str, Any]] = []
    for kind, value in pieces:
        if kind != "call":
            continue
        if calls and "id" not in value and calls[-1]["index"] == value["index"]:
            calls[-1]["function"]["arguments"] += value["function"]["arguments"]
        else:
            calls.append({**value, "function": dict(value["function"])})
    delta: dict[str, Any] = {"content": content} if content or not calls else {}
    if calls:
        delta["tool_calls"] = calls
    return delta
