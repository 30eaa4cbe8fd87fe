"""The disconnect guard: work a request waits for is cancelled if its client goes away.

A handler that has read its body awaits work (queueing for room, generating, embedding)
through :func:`until_disconnect`; when the ASGI server says ``http.disconnect``, the work's
task is cancelled, and what it submitted is released (a sequence cancelled, an embed request
dropped by the engine). A streamed response has its own watch (:mod:`laya_core.http.sse`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled if the client disconnects first (the body has been read)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
