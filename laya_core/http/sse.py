"""Server-sent events written straight to the ASGI ``send``: one ``data:`` line per event.

A streamed completion sends one event per generated token, so the cost of each event on the
event loop is paid per token, and that loop shares the CPU with the model's threads. This
response does only what the OpenAI streaming format needs: the frame, a ``: ping`` comment when
nothing was sent for ``ping_s``, and cancelling the event source when the client disconnects
(its ``finally`` then releases the request's sequences).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import suppress
from typing import Any

from starlette.types import Receive, Scope, Send

from laya_core.engine.layer_clock import HTTP, LayerClock, now_ns

_PING = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}


class SSEResponse:
    """An ASGI response streaming ``events`` (strings without newlines) as SSE ``data:`` lines.
    A subclass with another ``prefix`` (``b""``) sends events it frames itself."""

    prefix = b"data: "

    def __init__(self, events: AsyncIterator[str], headers: Mapping[str, str] | None = None,
                 ping_s: float = 15.0, clock: LayerClock | None = None) -> None:
        self.events = events
        self.clock = clock or LayerClock()  # each event's write is charged to its ``http``
        self.headers = dict(headers or {})
        self.ping_s = ping_s
        self._last_send = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {"content-type": "text/event-stream; charset=utf-8",
                   "cache-control": "no-cache", "x-accel-buffering": "no", **self.headers}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                for k, v in headers.items()]})
        self._last_send = time.monotonic()
        stream = asyncio.ensure_future(self._stream(send))
        helpers = [asyncio.ensure_future(self._watch_disconnect(receive, stream)),
                   asyncio.ensure_future(self._ping(send))]
        try:
            await stream
        except asyncio.CancelledError:
            if not stream.cancelled():  # this request itself was cancelled, not the stream
                raise
        finally:
            for task in (stream, *helpers):
                task.cancel()
            for task in (stream, *helpers):
                with suppress(asyncio.CancelledError):
                    await task

    async def _stream(self, send: Send) -> None:
        try:
            async for data in self.events:
                start = now_ns()
                await send({"type": "http.response.body",
                            "body": self.prefix + data.encode() + b"\n\n", "more_body": True})
                self._last_send = time.monotonic()
                self.clock.add(HTTP, start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watch_disconnect(self, receive: Receive, stream: asyncio.Future[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                stream.cancel()
                return

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last_send + self.ping_s - time.monotonic()))
            if time.monotonic() - self._last_send >= self.ping_s:
                await send(_PING)
                self._last_send = time.monotonic()
