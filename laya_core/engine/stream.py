"""The asyncio side of a request: the events an engine thread hands to an event loop.

The engine gathers a step's events and calls ``loop.call_soon_threadsafe(deliver, events)``
once per event loop (or per :class:`Courier`); each request reads its own queue through a
:class:`GenerationStream`.
Only immutable :class:`TokenEvent` objects cross from the engine thread; the stream holds
plain numbers of its own, never the engine's sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from laya_core.types import TokenEvent, Usage

# Sent when a sequence joins the batch: the HTTP layer answers only once a request runs.
ADMITTED = TokenEvent("", (), admitted=True)


class EventSink(Protocol):
    """What takes a request's events on its event loop (an ``asyncio.Queue`` does)."""

    def put_nowait(self, event: TokenEvent) -> None: ...


class Courier(Protocol):
    """Where the engine hands a step's events: an asyncio loop, whose thread then runs
    ``deliver``, or a replica's transport, which runs it on the engine thread and sends the
    step's message at once (laya_core/replica/worker.py: no thread hop per token)."""

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any: ...


def deliver(events: list[tuple[EventSink, TokenEvent]]) -> None:
    """Put each event in its request's queue; runs on the event loop."""
    for queue, event in events:
        queue.put_nowait(event)


class GenerationStream:
    """The asyncio side of one request: an async iterator of :class:`TokenEvent`.

    Read it from the event loop that submitted the request."""

    def __init__(self, request_id: int, num_prompt_tokens: int,
                 cancel: Callable[[int], None]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._cancel = cancel
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False
        self._admitted = False
        self._early_end: TokenEvent | None = None
        self._num_tokens = 0  # token ids received so far
        self._usage: Usage | None = None
        # Waits before the request reached its replica, as (layer, seconds): added to the
        # final event's queue time and named as layers of their own (a model's load).
        self.waits_before: list[tuple[str, float]] = []

    async def wait_admitted(self) -> TokenEvent | None:
        """Wait until the sequence joins the batch; the final event if it ended before that."""
        while not self._admitted and self._early_end is None:
            event = await self.queue.get()
            if event.admitted:
                self._admitted = True
            elif event.finish_reason is not None:
                self._early_end = event
        return self._early_end

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = self._early_end or await self.queue.get()
        while event.admitted:
            self._admitted = True
            event = await self.queue.get()
        self._num_tokens += len(event.token_ids)
        if event.finish_reason is not None:
            self.finished = True
            self._usage = event.usage
            if self.waits_before and event.timing is not None:
                waited = sum(s for _, s in self.waits_before)
                event = attrs.evolve(event, timing=attrs.evolve(
                    event.timing, queue_s=event.timing.queue_s + waited,
                    layers=(*event.timing.layers, *self.waits_before)))
        return event

    def cancel(self) -> None:
        """Leave the batch at the next step; safe to call at any time, more than once."""
        if not self.finished:
            self._cancel(self.request_id)

    @property
    def usage(self) -> Usage:
        """The sequence's token counts: the engine's, from the final event, once finished;
        before that, what has arrived so far."""
        if self._usage is not None:
            return self._usage
        return Usage(self.num_prompt_tokens, self._num_tokens)
