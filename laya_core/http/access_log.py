"""One access-log line per HTTP request (logger ``laya.access``), written when it ends.

A plain ASGI middleware, added outermost so that what inner layers refuse (401, 404, 405,
429, 503) is logged too. A streamed response is logged once, when its stream ends, with the
status it started with. The completion handlers add what only they know (the model, the
tokens, and where the time went) through :func:`note`. The request's record travels in a
context variable: the tasks a request starts (its stream, its disconnect watcher) inherit it,
and the handlers need no access to the ASGI scope.

A line: ``POST /v1/completions 200 model=smollm2 prompt_tokens=4 completion_tokens=16
route_ms=0.02 queue_ms=0.05 prefill_ms=9.81 decode_ms=95.40 total_ms=107.3``; times in
milliseconds, ``total_ms`` as the middleware saw it. ``disconnected`` marks a client that left
before the response was complete.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Mapping
from typing import Any

import attrs
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from laya_core.types import Timing

log = logging.getLogger("laya.access")


@attrs.define
class _Record:
    method: str
    path: str
    started: float  # perf_counter seconds
    status: int | None = None
    complete: bool = False  # the response's last body message was sent
    disconnected: bool = False
    fields: dict[str, str] = attrs.field(factory=dict)

    def line(self) -> str:
        parts = [self.method, self.path, str(self.status) if self.status else "-"]
        parts += [f"{key}={value}" for key, value in self.fields.items()]
        parts.append(f"total_ms={(time.perf_counter() - self.started) * 1000:.1f}")
        if self.disconnected:
            parts.append("disconnected")
        return " ".join(parts)


_record: contextvars.ContextVar[_Record | None] = contextvars.ContextVar(
    "laya_access_record", default=None)


def note(model: str, usage: Mapping[str, Any], route_s: float, timing: Timing | None,
         error: str | None = None) -> None:
    """Add a completion's model, tokens and timing to the current request's line, if any."""
    record = _record.get()
    if record is None:
        return
    fields = {"model": model, "prompt_tokens": str(usage["prompt_tokens"]),
              "completion_tokens": str(usage["completion_tokens"]),
              "route_ms": f"{route_s * 1000:.2f}"}
    if timing is not None:
        fields |= {"queue_ms": f"{timing.queue_s * 1000:.2f}",
                   "prefill_ms": f"{timing.prefill_s * 1000:.2f}",
                   "decode_ms": f"{timing.decode_s * 1000:.2f}"}
    if error is not None:
        fields["error"] = error
    record.fields |= fields


def _printable(path: str) -> str:
    """The path as one log line can hold it: a %0A in a URL must not forge a second line."""
    if path.isprintable() and " " not in path:
        return path
    return "".join(c if c.isprintable() and c != " " else f"\\x{ord(c):02x}" for c in path)


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = _Record(scope["method"], _printable(scope["path"]), time.perf_counter())

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not record.complete:
                record.disconnected = True
            return message

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                record.complete = True
            await send(message)

        token = _record.set(record)
        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception:
            # Starlette's outermost layer answers it with a 500 after it passed through here.
            record.status = record.status or 500
            raise
        finally:
            _record.reset(token)
            log.info("%s", record.line())
