"""Where a replica's time goes, layer by layer: monotonic-clock sums, always on.

Each layer of a token's way out is timed where it runs and summed here, nanoseconds and
calls, for ``laya:engine_layer_seconds_total`` (docs/metrics.md) and
``tools/profile_token.py``. The layers, in a token's order:

- ``loop``: the engine loop's own work between steps (the inbox's adds and cancels, the
  look for embedding work; an embedding pass itself is no token's time and not counted);
- ``schedule``: the step's plan (queue timeouts, ``Scheduler.schedule``, the cache
  policy's ops applied, the backend's items built);
- ``draft``: a draft model's compute before the step (speculative method "draft",
  laya_core/engine/draft_model.py); absent without one;
- ``prefill``: ``Backend.step`` of a step that feeds a prompt chunk (with the decodes
  beside it): the time before a sequence's first token, outside its inter-token gaps;
- ``backend``: ``Backend.step`` of a step of decodes only, the model's compute with its
  sampling and log-probabilities (both backends sample inside their step);
- ``detokenize``: what each sampled token means (the KV bookkeeping, text, stop strings,
  the end of a sequence) and its event built;
- ``deliver``: the step's events handed to the event loop that sends them;
- ``ipc_send``: a worker process's or Ray actor's step message (its snapshot, pickle,
  socket write), on the worker's sender thread;
- ``ipc_receive``: the front end's side of it (unpickle, and the events to their streams);
- ``http``: each SSE chunk's JSON and its write to the connection.

The first seven run on the engine thread one after another; the last three on other threads
and processes, beside the next step. A layer costs two ``perf_counter_ns`` calls and a list
update per step or message (about 0.2 µs), so the clock is never off.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

LAYERS = ("loop", "schedule", "draft", "prefill", "backend", "detokenize", "deliver",
          "ipc_send", "ipc_receive", "http")
(LOOP, SCHEDULE, DRAFT, PREFILL, BACKEND, DETOKENIZE, DELIVER, IPC_SEND, IPC_RECEIVE,
 HTTP) = range(len(LAYERS))

now_ns = time.perf_counter_ns


class LayerClock:
    """Nanoseconds and calls per layer (an index of :data:`LAYERS`). Each layer is added to
    by one thread only, so the sums need no lock; a reader copies them with :meth:`seconds`."""

    __slots__ = ("calls", "ns")

    def __init__(self) -> None:
        self.ns = [0] * len(LAYERS)
        self.calls = [0] * len(LAYERS)

    def add(self, layer: int, start_ns: int) -> int:
        """Charge ``layer`` with the time since ``start_ns``; returns now, the next start."""
        end = now_ns()
        self.ns[layer] += end - start_ns
        self.calls[layer] += 1
        return end

    def seconds(self) -> dict[str, float]:
        """Seconds per layer, of the layers that ran."""
        return {name: ns / 1e9 for name, ns, calls in zip(LAYERS, self.ns, self.calls,
                                                          strict=True) if calls}


def merged(*parts: Mapping[str, float]) -> dict[str, float]:
    """Seconds per layer summed over several clocks' :meth:`LayerClock.seconds`."""
    out: dict[str, float] = {}
    for part in parts:
        for name, seconds in part.items():
            out[name] = out.get(name, 0.0) + seconds
    return out
