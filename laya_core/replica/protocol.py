"""The messages a replica's front end and its engine's side send each other.

Both transports carry them: a worker process (:mod:`laya_core.replica.worker`, over a socket
pair with :mod:`multiprocessing.connection`: length-prefixed pickles of the plain frozen types
that already cross the engine's thread boundary) and a Ray actor
(:mod:`laya_core.replica.ray_actor`, through its ``send`` and polled ``events``). The front end
(:mod:`laya_core.replica.remote`) imports this module, never the child's.

Front end to replica:

- ``("init", ModelConfig, replica_id, plugin_specs)``, first and once (a worker process only:
  a Ray actor gets them as its constructor's arguments);
- ``("submit", rid, prompt_token_ids, SamplingParams, ConstraintSpec | None)``;
- ``("cancel", rid)``, ``("embed", rid, inputs)``, ``("embed_cancel", rid)`` (its caller
  went away: the engine drops what is left of it, and nothing is sent back),
  ``("adapter", rid, "load" | "unload", name, path | None)`` (a LoRA adapter while
  serving, laya_core/engine/adapters.py), ``("stop",)``.

Replica to front end:

- ``("loaded", Loaded)`` or ``("failed", why)`` once the load ended;
- ``("ack", rid)`` or ``("refused", rid, kind, message, param)`` for each submit
  (:func:`refusal_of` and :func:`refused` translate the error). A refused request has no
  events; an accepted one's first events may come before its ack (the engine thread sends
  them, the replica's event loop the ack), and they count as the ack;
- ``("events", [(rid, TokenEvent), ...], ReplicaSnapshot)``: one message per engine
  hand-over (a step, or a few decode steps within ``stream_interval_ms``) with every
  request's events since the last, not a message per token per request;
- ``("embedded", rid, Embeddings | None, kind, message, param)``, and for an adapter job
  ``("adapted", rid, LORA | None, kind, message, param)`` (kind None: done; LORA: the
  backend's adapters now, ``Backend.describe``'s "lora", which the front end's copy takes);
- ``("state", ReplicaSnapshot)`` every :data:`STATE_EVERY_S` while nothing else is sent, and
  ``("beat",)`` likewise while the model loads: the heartbeat by which the front end tells a
  live worker from a stuck one.
"""

from __future__ import annotations

from typing import Any

import attrs

from laya_core.engine.embed_jobs import EmbeddingsUnsupportedError
from laya_core.engine.limits import RequestTooLongError
from laya_core.engine.state import EngineUnavailableError, QueueFullError
from laya_core.replica.client import ReplicaInfo, ReplicaSnapshot
from laya_core.structured.spec import GrammarError

# Seconds between heartbeats (a state snapshot, or a beat while loading) of an idle replica.
STATE_EVERY_S = 0.25

# A refusal crosses as its kind; each side reads this one table. An error is the first
# class it is an instance of (GrammarError and EmbeddingsUnsupportedError before their
# base, ValueError). Anything else is the replica's failure: kind "error", a RuntimeError.
REFUSALS: tuple[tuple[str, type[Exception]], ...] = (
    ("grammar", GrammarError), ("too_long", RequestTooLongError),
    ("queue_full", QueueFullError), ("unavailable", EngineUnavailableError),
    ("unsupported", EmbeddingsUnsupportedError), ("value", ValueError))


def refusal_of(error: Exception) -> tuple[str, str, str | None]:
    """``(kind, message, param)`` of an error, to send to the front end."""
    kind = next((k for k, cls in REFUSALS if isinstance(error, cls)), "error")
    return kind, str(error), getattr(error, "param", None)


def refused(kind: str, message: str, param: str | None) -> Exception:
    """The front end's error for a refusal the replica sent."""
    if kind == "grammar":
        return GrammarError(param or "", message)
    return dict(REFUSALS).get(kind, RuntimeError)(message)


@attrs.frozen
class Loaded:
    """What the front end learns of a replica each time it has loaded: the replica's
    :class:`ReplicaInfo` itself, and what only a loaded engine can say besides."""

    info: ReplicaInfo
    # Embeddings served: the backend can (info.backend_embeds) and the manifest asks.
    supports_embeddings: bool
    runtime: dict[str, Any]  # Backend.describe, plain JSON values
    state: ReplicaSnapshot  # the first snapshot
    pid: int  # the replica's process
