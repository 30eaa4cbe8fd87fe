"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, run on
the chat path (the body translated by :mod:`laya_core.http.anthropic_requests`, results
shaped back by :mod:`laya_core.http.anthropic_format`).

Every error these routes answer is in Anthropic's shape (``{"type": "error", "error":
{"type", "message"}}``), the message starting with the field it is about.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http import anthropic_format as fmt
from laya_core.http import generation as gen
from laya_core.http.anthropic_requests import parse_messages, renamed
from laya_core.http.body import json_body
from laya_core.http.completion_requests import ChatRequest
from laya_core.http.completions import CompletionHandlers
from laya_core.http.errors import QUEUE_RETRY_AFTER_S, APIError, invalid
from laya_core.http.observe import Observer
from laya_core.http.replicas import ready_client
from laya_core.http.sse import SSEResponse
from laya_core.http.thinking import reasoning_of
from laya_core.serving.chat_template import TemplateError
from laya_core.serving.deployment import Deployment
from laya_core.serving.template_sandbox import TemplateUnavailableError
from laya_core.types import FinishReason, Timing

Handler = Callable[[Request], Awaitable[Response]]


def message_routes(deployment: Deployment, observer: Observer) -> list[Route]:
    handlers = MessageHandlers(deployment, observer)
    return [Route("/v1/messages", _anthropic_errors(handlers.create), methods=["POST"]),
            Route("/v1/messages/count_tokens", _anthropic_errors(handlers.count_tokens),
                  methods=["POST"])]


def _anthropic_errors(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return fmt.error_response(e)

    return wrapped


class MessagesSSE(SSEResponse):
    """Anthropic's stream: each event framed with its ``event:`` line (fmt.event)."""

    prefix = b""


async def _parse(body: Any, count_only: bool = False) -> ChatRequest:
    """The chat request; on a worker thread when there are tools (their schemas are
    compiled into the call grammar)."""
    if isinstance(body, dict) and body.get("tools"):
        return await asyncio.to_thread(parse_messages, body, count_only)
    return parse_messages(body, count_only)


class MessageHandlers:
    def __init__(self, deployment: Deployment, observer: Observer) -> None:
        self.deployment = deployment
        self.chat = CompletionHandlers(deployment, observer)  # its start, collect, observe

    async def count_tokens(self, request: Request) -> Response:
        req = await _parse(await json_body(request, self.deployment.manifest.server), True)
        async with ready_client(self.deployment, req.common.model) as (client, _):
            try:
                tokens = await asyncio.to_thread(gen.chat_ids, self.deployment, client, req)
            except TemplateError as e:
                raise invalid("messages", str(e), "chat_template_error") from None
            except TemplateUnavailableError as e:
                raise APIError(503, str(e), code="template_unavailable",
                               retry_after=QUEUE_RETRY_AFTER_S) from None
            return JSONResponse({"input_tokens": len(tokens)})

    async def create(self, request: Request) -> Response:
        req = await _parse(await json_body(request, self.deployment.manifest.server))
        try:
            runs, _, token_bytes = await self.chat.start(request, req, "msg", "message")
        except APIError as e:
            raise renamed(e) from None
        id_, model = fmt.new_id(), req.common.model
        if req.common.stream:
            return self._stream(runs, req, id_, token_bytes)
        (result,) = await self.chat.collect(request, runs, req)
        u = runs[0].stream.usage
        parser = gen.tool_parser(runs[0], req)
        stop = fmt.matched_stop(result.text, result.token_ids, token_bytes, req.common.stop) \
            if result.finish is FinishReason.STOP else None
        reasoning, answer = reasoning_of(runs[0], result)
        content = fmt.content_blocks(answer, parser, reasoning)  # feeds the parser, if any
        reason = fmt.stop_reason(result.finish, stop, parser)
        body = fmt.message(id_, model, content, reason,
                           stop if reason == "stop_sequence" else None,
                           fmt.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens))
        self.chat.finished(runs, req, [result.timing], gen.usage(runs, 1))
        timing = gen.server_timing(runs[0].route_s, result.timing)
        return JSONResponse(body, headers={"Server-Timing": timing})

    def _stream(self, runs: list[gen.Running], req: ChatRequest, id_: str,
                token_bytes: Callable[[int], bytes]) -> Response:
        run = runs[0]
        prompt = len(run.prompt_token_ids)
        parser = gen.tool_parser(run, req)
        blocks = fmt.StreamBlocks(parser, run.reasoning_parser())

        async def events() -> AsyncIterator[str]:
            timing: Timing | None = None
            error = None
            text: list[str] = []
            tokens: list[int] = []
            try:
                start = fmt.message(id_, req.common.model, [], None, None,
                                    fmt.usage(prompt, 0, 0))
                yield fmt.event("message_start", {"message": start})
                yield fmt.event("ping", {})
                async for _, event in gen.merged(runs):
                    if event.finish_reason is FinishReason.ERROR:
                        failure = gen.engine_error(event)
                        yield fmt.event("error", {"error": fmt.error_body(failure)["error"]})
                        error = failure.code
                        break
                    text.append(event.text)
                    tokens += event.token_ids
                    for data in blocks.feed(event.text, event.finish_reason is not None,
                                            len(event.token_ids), run.head_of(event.token_ids)):
                        yield data
                    if event.finish_reason is None:
                        continue
                    timing = event.timing
                    for data in blocks.close():
                        yield data
                    whole = "".join(text)
                    stop = fmt.matched_stop(whole, tokens, token_bytes, req.common.stop) \
                        if event.finish_reason is FinishReason.STOP else None
                    reason = fmt.stop_reason(event.finish_reason, stop, parser)
                    u = run.stream.usage
                    yield fmt.event("message_delta", {
                        "delta": {"stop_reason": reason,
                                  "stop_sequence": stop if reason == "stop_sequence" else None},
                        "usage": fmt.usage(u.prompt_tokens, u.cached_tokens,
                                           u.completion_tokens)})
                    yield fmt.event("message_stop", {})
                self.chat.finished(runs, req, [timing], gen.usage(runs, 1), error)
            finally:
                gen.release_all(runs)

        return MessagesSSE(events(), clock=run.client.clock)  # type: ignore[return-value]

