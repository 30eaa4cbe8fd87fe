"""Anthropic's Messages API over the chat path: results, stream events and errors shaped as
Anthropic's. The request body is checked and translated into a chat request by
:mod:`laya_core.http.anthropic_requests`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.responses import JSONResponse

from laya_core.http.errors import APIError
from laya_core.structured.reasoning import ReasoningParser
from laya_core.structured.tool_parsers import CallParser
from laya_core.types import FinishReason

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


# -- errors ---------------------------------------------------------------------------------

def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(e: APIError) -> dict[str, Any]:
    """Anthropic's error object; the message starts with the field it is about."""
    message = e.message if not e.param or e.message.startswith(f"{e.param}:") \
        else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": error_type(e.status), "message": message}}


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else {}
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


# -- responses ------------------------------------------------------------------------------

def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from the (prefix) cache."""
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def matched_stop(text: str, token_ids: Iterable[int], token_bytes: Callable[[int], bytes],
                 stops: Sequence[str]) -> str | None:
    """The stop sequence that ended an output whose shown text is ``text``, if one did: the
    tokens generated decode to the text followed by it (the engine cuts it from the text)."""
    if not stops:
        return None
    full = b"".join(token_bytes(t) for t in token_ids).decode("utf-8", "replace")
    if not full.startswith(text):
        return None
    rest = full[len(text):]
    return next((s for s in stops if rest.startswith(s)), None)


def stop_reason(finish: FinishReason, stop: str | None,
                parser: CallParser | None) -> str:
    if finish is FinishReason.LENGTH:
        return "max_tokens"
    if parser is not None and parser.calls and parser.complete:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:  # cut short by max_tokens: what was generated is all there is
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(text: str, parser: CallParser | None,
                   reasoning: str | None = None) -> list[dict[str, Any]]:
    """The message's content: a reasoning model's thinking, its text, and with tools the
    calls as tool_use blocks."""
    thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}] \
        if reasoning else []
    if parser is None:
        return thinking + ([{"type": "text", "text": text}] if text else [])
    pieces = parser.feed(text) + parser.finish()
    content = "".join(v for kind, v in pieces if kind == "content")
    blocks: list[dict[str, Any]] = thinking + (
        [{"type": "text", "text": content}] if content else [])
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": _input(c["function"]["arguments"])} for c in parser.calls]
    return blocks


def message(id_: str, model: str, content: list[dict[str, Any]], reason: str | None,
            stop: str | None, use: dict[str, int]) -> dict[str, Any]:
    return {"id": id_, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": use}


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic frames it (see :class:`MessagesSSE`)."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}"


class StreamBlocks:
    """Turns a stream's text into content-block events: text blocks, and with tools a
    tool_use block per call whose arguments arrive as input_json deltas."""

    def __init__(self, parser: CallParser | None, thinker: ReasoningParser | None = None) -> None:
        self.parser = parser
        self.thinker = thinker  # a reasoning model's: its thinking in a block of its own
        self.index = -1
        self.open: str | None = None  # the type of the block open now

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"index": self.index,
                                                    "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, text: str, last: bool, tokens: int = 0,
             head: Callable[[int], str] | None = None) -> list[str]:
        if self.thinker is None:
            return self._answer(text, last)
        out: list[str] = []
        pieces = self.thinker.feed(text, tokens, head) + (
            self.thinker.finish() if last else [])
        for kind, value in pieces:
            if kind == "reasoning":
                if self.open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
            else:
                out += self._answer(value, False)
        return out + (self._answer("", True) if last else [])

    def _answer(self, text: str, last: bool) -> list[str]:
        if self.parser is None:
            pieces: list[tuple[str, Any]] = [("content", text)] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if last else [])
        out: list[str] = []
        for kind, value in pieces:
            if kind == "content":
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": value}))
                continue
            if "id" in value:
                out += self._start({"type": "tool_use", "id": value["id"],
                                    "name": value["function"]["name"], "input": {}})
            if value["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": value["function"]["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]
