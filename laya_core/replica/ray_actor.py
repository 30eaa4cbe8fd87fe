"""A replica as a Ray actor: :mod:`laya_core.replica.worker`'s engine and messages, polled.

:class:`ReplicaActor` is a plain class; :mod:`laya_core.replica.ray_client` makes it a Ray actor
(``ray.remote`` with the replica's resources), so this module imports no Ray. Its
``__init__`` loads the engine (Ray runs it again when it restarts the actor), then serves
the worker's protocol on an asyncio loop of its own thread: ``send(message)`` hands the
front end's submit, cancel, embed, embed_cancel or stop to that loop, and ``events(timeout_s)`` returns
every message since the last call (acks, refusals, one ``("events", ...)`` per engine step,
embeddings, state), waiting up to ``timeout_s`` for the first. The front end keeps one such
long poll in flight per replica, so a busy replica costs one round trip per poll, never a
message per token per request. The actor runs its methods on a few threads
(``max_concurrency``), so a poll waiting does not hold up a submit.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from laya_core.backend import ModelConfig
from laya_core.logs import setup_logging, start_named
from laya_core.replica.worker import _Worker, build_engine, loaded_of, serve_engine


class _Outbox:
    """Messages for the front end, taken all at once by its poll."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._items: list[tuple[Any, ...]] = []

    def put(self, message: tuple[Any, ...]) -> None:
        with self._ready:
            self._items.append(message)
            self._ready.notify_all()

    def take(self, timeout_s: float) -> list[tuple[Any, ...]]:
        with self._ready:
            self._ready.wait_for(lambda: self._items, timeout_s)
            out, self._items = self._items, []
        return out


class ReplicaActor:
    """One replica's engine inside a Ray actor; see the module docstring."""

    def __init__(self, config: ModelConfig, replica_id: int, plugins: list[str]) -> None:
        setup_logging()
        self._outbox = _Outbox()
        self._worker: _Worker | None = None
        self._started = threading.Event()
        engine = build_engine(config, replica_id, plugins)
        engine.start()
        if not engine.wait_ready():  # a Python-level load error: a restart would repeat it
            self._first: tuple[str, Any] = ("failed", engine.error or engine.state.value)
            engine.stop()
            return
        self._first = ("loaded", loaded_of(engine))
        start_named(threading.Thread(target=self._serve, args=(engine,), daemon=True,
                                     name="laya-ray-replica"), "laya-ray-serve")
        self._started.wait()

    def _serve(self, engine: Any) -> None:
        def started(worker: _Worker) -> None:
            self._worker = worker
            self._started.set()

        try:
            asyncio.run(serve_engine(engine, self._outbox.put, started))
        finally:
            engine.stop()

    def loaded(self) -> tuple[str, Any, str]:
        """``("loaded", Loaded, node id)``, or ``("failed", why, node id)``."""
        import ray

        return (*self._first, ray.get_runtime_context().get_node_id())

    def send(self, message: tuple[Any, ...]) -> None:
        """One of the front end's messages (laya_core/replica/protocol.py)."""
        worker = self._worker
        if worker is not None:
            worker.loop.call_soon_threadsafe(worker.handle, message)

    def events(self, timeout_s: float) -> list[tuple[Any, ...]]:
        """Every message since the last call, after waiting up to ``timeout_s`` for one."""
        return self._outbox.take(timeout_s)

    def pid(self) -> int:
        return os.getpid()
