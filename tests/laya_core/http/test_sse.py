"""The SSE response: framing, pings while idle, and cancelling on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from laya_core.http.sse import SSEResponse


def run(response: SSEResponse, disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if disconnect_after_s is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(disconnect_after_s)  # type: ignore[arg-type]
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), 5))
    return sent


def test_events_are_framed_and_pings_fill_silences() -> None:
    async def events() -> AsyncIterator[str]:
        yield '{"a": 1}'
        await asyncio.sleep(0.35)
        yield "[DONE]"

    sent = run(SSEResponse(events(), headers={"x-test": "1"}, ping_s=0.1))
    start, *bodies = sent
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-test", b"1") in start["headers"]
    frames = [m["body"] for m in bodies]
    assert frames[0] == b'data: {"a": 1}\n\n' and frames[-2:] == [b"data: [DONE]\n\n", b""]
    assert 2 <= frames.count(b": ping\n\n") <= 4 and bodies[-1]["more_body"] is False


def test_a_disconnect_closes_the_event_source() -> None:
    closed = []

    async def events() -> AsyncIterator[str]:
        try:
            while True:
                yield "tick"
                await asyncio.sleep(0.02)
        finally:
            closed.append(True)  # where the handler gives its sequences back

    sent = run(SSEResponse(events()), disconnect_after_s=0.2)
    assert closed == [True]
    assert 3 <= len(sent) and all(m.get("more_body", True) for m in sent)  # no normal end
