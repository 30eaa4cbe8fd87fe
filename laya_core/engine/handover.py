"""The engine thread's events on their way out: gathered during a step by the courier that
carries them (an event loop, a worker's transport), handed over in one call per courier,
and held for the next decode step's tokens while the model's ``stream_interval_ms`` allows.

Each hand-over wakes the threads and processes that carry it to the client (a worker's
sender, the front end's reader and event loop), and on a machine whose cores the model's
threads fill every wake-up takes its CPU from the model: at concurrency 1, holding a token
for the next one or two made tokens/s 1.00-1.08x by round and the median request's time
per token 3-9% less (AMD EPYC, docs/benchmarks.md). First tokens, ends, admissions and
errors never wait, so TTFT and the end of a response are unchanged; the engine hands over
before any step that feeds a prompt (long), and before an embedding pass. Tokens wait for
``HELD_STEPS`` more decode steps at most, however short the steps: a backend whose step takes
microseconds would otherwise finish a request inside one interval, before its client saw a
token to cancel after (the conformance suite's toy backend did: 200 tokens in one hand-over).

A request's tokens held together leave as one event (:func:`joined`): its text, token ids
and samples in order, as a speculative step's several tokens do. They reach the client in
one burst either way; as one event they cost the worker's pickle, the front end's queue, its
generator, its JSON and its socket write once, not once per token (vLLM's ``stream_interval``
makes one chunk of the tokens it holds the same way). With ``stream_interval_ms = 0`` nothing
is held and every token is an event of its own; so is each token of a sequence with a
constraint, whose reasoning budget the HTTP side counts in its stream's tokens.
"""

from __future__ import annotations

import time

import attrs

from laya_core.engine.progress import Live
from laya_core.engine.stream import Courier, EventSink, deliver
from laya_core.types import FinishReason, TokenEvent

HELD_STEPS = 3  # decode steps a hand-over may wait for; it carries four steps' tokens at most


class Outbox:
    """The events made since the last hand-over, by courier; used on the engine thread only."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s  # the longest a token may wait; 0: never
        self._events: dict[Courier, list[tuple[EventSink, TokenEvent]]] = {}
        # Where each request's last event stands in its courier's list, by its sink.
        self._last: dict[EventSink, int] = {}
        self._since = 0.0  # when the oldest was made (perf_counter s)
        self._urgent = False  # one of them leaves at the next hand-over
        self._held = 0  # decode steps they have waited for
        self.decode_s = 0.0  # the last decode step's model call: the next one's forecast

    def add(self, live: Live, event: TokenEvent) -> None:
        if not self._events:
            self._since = time.perf_counter()
        if event.finish_reason is not None or not event.token_ids or \
                len(live.seq.output_token_ids) <= len(event.token_ids):
            self._urgent = True  # an admission, an end, an error or a first token
        batch = self._events.setdefault(live.loop, [])
        i = self._last.get(live.queue)
        # A constrained sequence's events stay a token's each: a reasoning budget ends at a
        # token, and the HTTP side finds that token by counting its stream's tokens.
        if i is not None and live.seq.constraint is None:
            merged = joined(batch[i][1], event)
            if merged is not None:
                batch[i] = (live.queue, merged)
                return
        self._last[live.queue] = len(batch)
        batch.append((live.queue, event))

    def may_wait(self) -> bool:
        """Whether the events may wait for the coming decode step's: none is urgent, they
        have waited for fewer than ``HELD_STEPS`` steps, and the oldest would still leave
        within the interval after that step. Asked once before each decode step."""
        wait = self.interval_s > 0 and not self._urgent and self._held < HELD_STEPS and \
            time.perf_counter() - self._since + self.decode_s < self.interval_s
        self._held += wait
        return wait

    def hand_over(self) -> bool:
        """Each courier's events in one call (``deliver`` on its side); False when none."""
        if not self._events:
            return False
        events, self._events = self._events, {}
        self._last.clear()
        self._urgent, self._held = False, 0
        for courier, batch in events.items():
            try:
                courier.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is left to read these requests
                pass
        return True


def joined(held: TokenEvent, event: TokenEvent) -> TokenEvent | None:
    """``held`` and then ``event``, one request's, as one event; None where they must stay
    apart: ``held`` is no plain token event (an admission, an end), or ``event`` is an
    admission or an error (the tokens before an error are content; the error is not)."""
    if held.finish_reason is not None or held.admitted or not held.token_ids or \
            event.admitted or event.finish_reason is FinishReason.ERROR or event.error:
        return None
    return attrs.evolve(event, text=held.text + event.text,
                        token_ids=held.token_ids + event.token_ids,
                        samples=held.samples + event.samples,
                        prompt_logprobs=held.prompt_logprobs or event.prompt_logprobs)
