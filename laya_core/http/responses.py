"""POST /v1/responses (OpenAI's Responses API), run on the chat completions path.

A request becomes a chat request (:mod:`laya_core.http.responses_format`) and runs as one:
the same prompt, constraint and tool-call parser, so at temperature 0 its text is chat's.
The response is a ``response`` object with ``message`` and ``function_call`` output items;
streamed, the documented events with a ``sequence_number`` each, from ``response.created``
to ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it).

Unless ``store`` is false, a response is kept in a bounded in-memory store
(:mod:`laya_core.http.response_store`) for GET and DELETE /v1/responses/{id} and for a
later ``previous_response_id``, whose conversation then comes before the new input (its
prompt a prefix of the new one, so the prefix cache serves it); an id not (or no longer)
stored is a 404 naming it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.engine.layer_clock import HTTP, now_ns
from laya_core.http import generation as gen
from laya_core.http.body import json_body
from laya_core.http.completions import CompletionHandlers
from laya_core.http.errors import APIError, invalid
from laya_core.http.observe import Observer
from laya_core.http.response_store import ResponseStore, output_messages
from laya_core.http.responses_format import ResponsesRequest, parse_responses, renamed
from laya_core.http.sse import SSEResponse
from laya_core.http.thinking import reasoning_of
from laya_core.serving.deployment import Deployment
from laya_core.structured.reasoning import ReasoningParser
from laya_core.structured.tool_parsers import CallParser
from laya_core.types import FinishReason, Timing


def response_routes(deployment: Deployment, observer: Observer) -> list[Route]:
    handlers = ResponseHandlers(CompletionHandlers(deployment, observer))
    return [Route("/v1/responses", handlers.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", handlers.stored, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", handlers.input_items,
                  methods=["GET"])]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage object in the Responses API's names."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get(
                "completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status,
            "role": "assistant", "content": [_part(text)]}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A reasoning item with the model's reasoning as its text (as open-weight servers write
    it; no summary is made)."""
    return {"type": "reasoning", "id": item_id or _id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


class ResponseHandlers:
    def __init__(self, chat: CompletionHandlers) -> None:
        self.chat = chat  # its start, collect and bookkeeping, shared
        self.store = ResponseStore()

    def _stored(self, response_id: str, param: str) -> Any:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r} (responses sent "
                           "with store false, deleted or past the store's bound are not kept)",
                           param=param, code="not_found")
        return stored

    async def stored(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self._stored(response_id, "response_id")
        if request.method == "DELETE":
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return JSONResponse(stored.response)

    async def input_items(self, request: Request) -> Response:
        """A stored response's input items, a page at a time, as OpenAI lists them: ``order``
        "desc" (the default: the last item first) or "asc", ``limit`` 1 to 100 (20), and
        ``after`` an item id of the list, to start after it."""
        stored = self._stored(request.path_params["response_id"], "response_id")
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", f"'order' must be 'asc' or 'desc', got {order!r}")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise invalid("limit", "'limit' must be an integer from 1 to 100, got "
                          f"{query.get('limit')!r}")
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid("after", f"no input item with id {after!r} in this response",
                              code="not_found")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > limit})

    def _keep(self, req: ResponsesRequest, body: dict[str, Any]) -> None:
        if req.store:
            self.store.put(body, [*req.conversation, *output_messages(body["output"])],
                           req.input_items)

    def _object(self, req: ResponsesRequest, response_id: str, created: int, status: str,
                output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": created,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "model": req.chat.common.model, "output": output,
                "reasoning": {"effort": None, "summary": None},
                "store": req.store, "truncation": "disabled", **req.echo,
                "usage": response_usage(usage) if usage is not None else None}

    async def create(self, request: Request) -> Response:
        body = await json_body(request, self.chat.server)
        history = ()
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None:
            if not isinstance(previous, str):
                raise invalid("previous_response_id", "'previous_response_id' must be a "
                              "string", "invalid_type")
            history = self._stored(previous, "previous_response_id").conversation
        if isinstance(body, dict) and (body.get("text") or body.get("tools")):
            # Checking schemas takes time the event loop must not wait for (see _parsed).
            req = await asyncio.to_thread(parse_responses, body, history)
        else:
            req = parse_responses(body, history)
        try:
            runs, _, _ = await self.chat.start(request, req.chat, "resp", "response")
        except APIError as e:
            raise renamed(e) from None
        response_id, created = _id("resp"), int(time.time())
        if req.chat.common.stream:
            return self._stream(req, runs, response_id, created)
        (result,) = await self.chat.collect(request, runs, req.chat)
        output: list[dict[str, Any]] = []
        status = "incomplete" if result.finish is FinishReason.LENGTH else "completed"
        reasoning, text = reasoning_of(runs[0], result)
        if reasoning:
            output.append(_reasoning(reasoning, "completed"))
        parser = gen.tool_parser(runs[0], req.chat)
        if parser is not None:
            text = "".join(v for kind, v in parser.feed(text) + parser.finish()
                           if kind == "content")
            calls = [_call(c, status) for c in parser.calls]
        else:
            calls = []
        if text or not calls:
            output.append(_message(text, status))
        output += calls
        usage = gen.usage(runs, 1)
        self.chat.finished(runs, req.chat, [result.timing], usage)
        body = self._object(req, response_id, created, status, output, usage)
        self._keep(req, body)
        return JSONResponse(body, headers={"Server-Timing": gen.server_timing(
            runs[0].route_s, result.timing)})

    def _stream(self, req: ResponsesRequest, runs: list[gen.Running], response_id: str,
                created: int) -> Response:
        clock = runs[0].client.clock
        events = _Events(self, req, response_id, created)
        events.parser = gen.tool_parser(runs[0], req.chat)
        events.thinker = runs[0].reasoning_parser()

        async def stream() -> AsyncIterator[str]:
            timing: Timing | None = None
            error = None
            try:
                yield events.emit("response.created", response=events.snapshot("in_progress"))
                yield events.emit("response.in_progress",
                                  response=events.snapshot("in_progress"))
                async for _, event in gen.merged(runs):
                    if event.finish_reason is FinishReason.ERROR:
                        failure = gen.engine_error(event)
                        error = failure.code
                        yield events.emit("error", code=failure.code, message=failure.message,
                                          param=None)
                        break
                    start = now_ns()
                    last = event.finish_reason is not None
                    for data in events.text(event.text, last, len(event.token_ids),
                                            runs[0].head_of(event.token_ids)):
                        yield data
                    if last:
                        timing = event.timing
                        status = "incomplete" if event.finish_reason is FinishReason.LENGTH \
                            else "completed"
                        for data in events.close(status):
                            yield data
                        final = events.snapshot(status, gen.usage(runs, 1))
                        self._keep(req, final)
                        yield events.emit(f"response.{status}", response=final)
                    clock.add(HTTP, start)
                usage = gen.usage(runs, 1)
                self.chat.finished(runs, req.chat, [timing], usage, error)
            finally:
                gen.release_all(runs)

        return SSEResponse(stream(), clock=clock)  # type: ignore[return-value]


class _Events:
    """The events of one streamed response, numbered, with the output items they build."""

    def __init__(self, handlers: ResponseHandlers, req: ResponsesRequest, response_id: str,
                 created: int) -> None:
        self.handlers, self.req = handlers, req
        self.response_id, self.created = response_id, created
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being written
        self.parser: CallParser | None = None  # the caller's, in its model's format
        self.thinker: ReasoningParser | None = None  # a reasoning model's

    def emit(self, kind: str, **fields: Any) -> str:
        """One event; its ``event:`` field follows the data line (SSE takes fields in any
        order), as OpenAI names each event."""
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"{data}\nevent: {kind}"

    def snapshot(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.handlers._object(self.req, self.response_id, self.created, status,
                                     list(self.output), usage)

    def text(self, text: str, last: bool, tokens: int = 0,
             head: Callable[[int], str] | None = None) -> list[str]:
        if self.thinker is not None:  # its reasoning first, as an item of its own
            out: list[str] = []
            pieces = self.thinker.feed(text, tokens, head) + (
                self.thinker.finish() if last else [])
            for kind, value in pieces:
                out += self._reasoning(value) if kind == "reasoning" else \
                    self._answer(value, False)
            return out + (self._answer("", True) if last else [])
        return self._answer(text, last)

    def _reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self._close_open("completed")
            self.open = _reasoning("", "in_progress")
            out.append(self.emit("response.output_item.added", output_index=len(self.output),
                                 item={**self.open, "content": []}))
        self.open["content"][0]["text"] += text
        out.append(self.emit("response.reasoning_text.delta", item_id=self.open["id"],
                             output_index=len(self.output), content_index=0, delta=text))
        return out

    def _answer(self, text: str, last: bool) -> list[str]:
        if self.parser is None:
            return self._content(text) if text else []
        out: list[str] = []
        for kind, value in self.parser.feed(text) + (self.parser.finish() if last else []):
            if kind == "content":
                out += self._content(value)
            elif "id" in value:  # a new call
                out += self._close_open("completed")
                item = {**_call({"id": value["id"], "function": {
                    "name": value["function"]["name"], "arguments": ""}}, "in_progress")}
                self.open = item
                out.append(self.emit("response.output_item.added",
                                     output_index=len(self.output), item=dict(item)))
                if value["function"].get("arguments"):
                    out += self._arguments(value["function"]["arguments"])
            else:
                out += self._arguments(value["function"]["arguments"])
        return out

    def _content(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "message":
            out += self._close_open("completed")
            self.open = _message("", "in_progress")
            item = {**self.open, "content": []}
            out.append(self.emit("response.output_item.added",
                                 output_index=len(self.output), item=item))
            out.append(self.emit("response.content_part.added", item_id=self.open["id"],
                                 output_index=len(self.output), content_index=0,
                                 part=_part("")))
        self.open["content"][0]["text"] += text
        out.append(self.emit("response.output_text.delta", item_id=self.open["id"],
                             output_index=len(self.output), content_index=0, delta=text,
                             logprobs=[]))
        return out

    def _arguments(self, delta: str) -> list[str]:
        assert self.open is not None
        self.open["arguments"] += delta
        return [self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                          output_index=len(self.output), delta=delta)]

    def _close_open(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.output)
        out: list[str] = []
        if item["type"] == "reasoning":
            out.append(self.emit("response.reasoning_text.done", item_id=item["id"],
                                 output_index=index, content_index=0,
                                 text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.emit("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"],
                                 logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part))
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, name=item["name"],
                                 arguments=item["arguments"]))
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def close(self, status: str) -> list[str]:
        """The open item's end; a response with no output item gets an empty message."""
        out: list[str] = []
        if self.open is None and not self.output:
            out += self._content("")
        return out + self._close_open(status)
