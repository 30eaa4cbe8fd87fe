"""A replica in a process of its own: the child side.

``python -m laya_core.replica.worker FD`` runs one replica's engine. The front end (the HTTP
server's process, :mod:`laya_core.replica.worker_client`) talks to it over a socket pair in
the messages of :mod:`laya_core.replica.protocol`. A native crash in the backend ends this
process, not the server.

Each engine step's events leave in one ``("events", ...)`` message. The engine thread hands
them to a sender thread of their own (:class:`_Courier`), which reads the replica's state,
pickles and writes while the next step's model call runs: the step waits for none of it,
and a token costs no wake-up of this process's event loop. The heartbeat is
sent by a thread of its own (see :func:`_heartbeat`), from this process's start, so that
the front end tells a live worker from a stuck one even while the model loads.

The constraint of a submit is compiled here, on a worker thread of this process, never on
the engine thread. When the front end goes away (its end of the socket closes) the worker
stops its engine and exits.

The same messages, minus the socket, make a Ray actor (:mod:`laya_core.replica.ray_actor`):
:func:`build_engine` and :func:`serve_engine` are shared with it.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from laya_core.backend import ModelConfig
from laya_core.engine.engine import Engine
from laya_core.engine.layer_clock import IPC_SEND, now_ns
from laya_core.engine.state import EngineState, EngineUnavailableError, QueueFullError
from laya_core.logs import start_named
from laya_core.replica.client import LocalEngineClient, ReplicaSnapshot, info_of
from laya_core.replica.protocol import STATE_EVERY_S, Loaded, refusal_of
from laya_core.types import TokenEvent

log = logging.getLogger("laya.worker")


def import_plugins(specs: list[str]) -> list[object]:
    """``module:attribute`` plugin objects to register beside the installed ones."""
    out = []
    for spec in specs:
        module, _, attr = spec.partition(":")
        out.append(getattr(importlib.import_module(module), attr))
    return out


class _Link:
    """The socket's sending side, shared by the loop, the heartbeat and the main thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.last_sent = time.monotonic()
        # Once "loaded" has been sent, beats carry the replica's state.
        self.state: Callable[[], ReplicaSnapshot] | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(message)
            self.last_sent = time.monotonic()


def _heartbeat(link: _Link) -> None:
    """Send something every :data:`STATE_EVERY_S` while nothing else goes out, from this
    process's start until the front end goes away. A thread of its own, so that neither a long
    engine step nor a long load holds it back: the backends run their model calls with the
    GIL released (llama.cpp through ctypes, torch's kernels), and this thread needs it for
    microseconds. So silence means the process is stopped, frozen or wedged, never busy."""
    while True:
        time.sleep(STATE_EVERY_S)
        if time.monotonic() - link.last_sent < STATE_EVERY_S:
            continue
        state = link.state
        try:
            link.send(("state", state()) if state is not None else ("beat",))
        except OSError:  # the front end went away
            return


class _Forward:
    """One request's sink: its events join the step's message (see the module docstring)."""

    def __init__(self, worker: _Worker, rid: int) -> None:
        self._worker = worker
        self._rid = rid

    def put_nowait(self, event: TokenEvent) -> None:
        self._worker.outgoing(self._rid, event)


class _Courier:
    """Where the engine hands each step's events (laya_core/engine/stream.py's ``Courier``):
    on the engine thread, into the requests' :class:`_Forward` sinks, then to the sender
    thread (:meth:`_Worker.sender`) through a queue. A queue's put and a thread's wake-up
    cost less than an event loop's (its self-pipe and selector), and sending on the engine
    thread itself puts the pickle and the socket write between two model calls. Measured
    at concurrency 1 with llama.cpp (Intel Xeon, 2 vCPUs, three alternating rounds): the
    client's inter-token gap less the model's step was 0.23-0.24 ms this way, against
    0.30-0.59 ms through the event loop and 0.53-0.55 ms sent from the engine thread."""

    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> None:
        callback(*args)
        self._worker.hand_over()


class _Worker:
    """One replica's side of the protocol; ``send`` carries a message to the front end
    (raising OSError once it has gone away)."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None], engine: Engine) -> None:
        self._transport = send
        self.engine = engine
        self.client = LocalEngineClient(engine)  # its state() and grammars()
        self.loop = asyncio.get_running_loop()
        # The streams under way, for their cancels; only this loop writes it.
        self.streams: dict[int, Any] = {}
        self._cancelled: set[int] = set()  # cancels that came before their submit ran
        self.embeds: dict[int, asyncio.Future[None]] = {}  # embed requests under way
        self._courier = _Courier(self)
        self._outbox: list[tuple[int, TokenEvent]] = []  # the engine thread's
        self._ended: list[int] = []  # requests of the outbox that finished
        # Steps' events for the sender thread; None stops it.
        self._steps: queue.SimpleQueue[tuple[list[tuple[int, TokenEvent]], list[int]] | None]
        self._steps = queue.SimpleQueue()
        self._last_sent = time.monotonic()
        self._send_lock = threading.Lock()
        self.done = asyncio.Event()

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._transport(message)
        except OSError:  # the front end went away; the reader ends the worker
            try:  # from the loop's thread or the sender's
                self.loop.call_soon_threadsafe(self.done.set)
            except RuntimeError:  # the loop has closed already
                pass
        self._last_sent = time.monotonic()

    def outgoing(self, rid: int, event: TokenEvent) -> None:
        """One event of the step the engine thread is handing over."""
        self._outbox.append((rid, event))
        if event.finish_reason is not None:
            self._ended.append(rid)

    def hand_over(self) -> None:
        """The step's events to the sender thread (on the engine thread)."""
        events, self._outbox = self._outbox, []
        ended, self._ended = self._ended, []
        self._steps.put((events, ended))

    def sender(self) -> None:
        """The sender thread: each step's events leave in one message, with the replica's
        state; the streams that ended are forgotten on the loop."""
        while (step := self._steps.get()) is not None:
            start = now_ns()
            events, ended = step
            while len(events) < 4096:  # steps that queued up while it sent go together
                try:
                    more = self._steps.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._steps.put(None)
                    break
                events, ended = events + more[0], ended + more[1]
            self.send(("events", events, self.client.state()))
            if ended:
                try:
                    self.loop.call_soon_threadsafe(self._forget, ended)
                except RuntimeError:  # the loop has closed: the worker is ending
                    pass
            self.engine.clock.add(IPC_SEND, start)  # in the next snapshot

    def stop_sender(self) -> None:
        self._steps.put(None)

    def _forget(self, ended: list[int]) -> None:
        for rid in ended:
            self.streams.pop(rid, None)

    def handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            asyncio.ensure_future(self._submit(*message[1:]))
        elif kind == "cancel":
            stream = self.streams.get(message[1])
            if stream is not None:
                stream.cancel()
            else:
                self._cancelled.add(message[1])
        elif kind == "embed":
            self.embeds[message[1]] = asyncio.ensure_future(self._embed(*message[1:]))
        elif kind == "embed_cancel":
            task = self.embeds.pop(message[1], None)
            if task is not None:  # cancels the engine's future, which tells the engine
                task.cancel()
        elif kind == "adapter":
            asyncio.ensure_future(self._adapter(*message[1:]))
        elif kind == "stop":
            self.done.set()

    async def _submit(self, rid: int, prompt: list[int], params: Any, spec: Any) -> None:
        try:
            matcher = None
            if spec is not None:
                matcher = await asyncio.to_thread(self.client.grammars().constraint, spec)
            stream = self.engine.submit(prompt, params, self._courier, constraint=matcher,
                                        sink=_Forward(self, rid))
        except (ValueError, EngineUnavailableError, QueueFullError) as e:
            self.send(("refused", rid, *refusal_of(e)))
            return
        self.send(("ack", rid))
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            stream.cancel()
        else:  # its end, if it came already, is forgotten after this callback
            self.streams[rid] = stream

    async def _embed(self, rid: int, inputs: list[list[int]]) -> None:
        try:
            result = await self.engine.embed(inputs)
        except asyncio.CancelledError:  # embed_cancel: the front end has forgotten it
            return
        except Exception as e:  # noqa: BLE001 - the front end raises the matching error
            self.send(("embedded", rid, None, *refusal_of(e)))
            return
        finally:
            self.embeds.pop(rid, None)
        self.send(("embedded", rid, result, None, None, None))

    async def _adapter(self, rid: int, op: str, name: str, path: str | None) -> None:
        try:
            await asyncio.wrap_future(self.engine.adapter(op, name, path))
        except Exception as e:  # noqa: BLE001 - the front end raises the matching error
            self.send(("adapted", rid, None, *refusal_of(e)))
            return
        # The backend's adapters now (Backend.describe's "lora"), for the front end's /ready.
        self.send(("adapted", rid, self.engine.runtime().get("lora"), None, None, None))

    async def heartbeat(self) -> None:
        while not self.done.is_set():
            await asyncio.sleep(STATE_EVERY_S)
            if time.monotonic() - self._last_sent >= STATE_EVERY_S:
                self.send(("state", self.client.state()))


def _read(conn: Connection, worker: _Worker) -> None:
    """The socket's reader, on a thread of its own: messages go to the loop."""
    try:
        while True:
            message = conn.recv()
            worker.loop.call_soon_threadsafe(worker.handle, message)
            if message[0] == "stop":
                return
    except (EOFError, OSError):  # the front end went away
        worker.loop.call_soon_threadsafe(worker.done.set)


async def serve_engine(engine: Engine, send: Callable[[tuple[Any, ...]], None],
                       started: Callable[[_Worker], None], heartbeat: bool = True) -> None:
    """Serve a loaded engine's protocol until the front end stops it or goes away;
    ``started`` gets the worker once it exists, to feed it the front end's messages
    (``worker.handle`` on ``worker.loop``). ``heartbeat``: send the idle state messages
    from this loop (a worker process sends them from its own thread instead)."""
    worker = _Worker(send, engine)
    sender = threading.Thread(target=worker.sender, name="laya-worker-sender", daemon=True)
    start_named(sender, "laya-sender")
    started(worker)
    beat = asyncio.ensure_future(worker.heartbeat()) if heartbeat else None
    try:
        await worker.done.wait()
    finally:
        if beat is not None:
            beat.cancel()
        worker.stop_sender()


def build_engine(config: ModelConfig, replica_id: int, plugins: list[str]) -> Engine:
    """The replica's engine, from the installed plugins and ``plugins`` (not started)."""
    from laya_core.plugins import load_registry

    registry = load_registry(import_plugins(plugins))
    return Engine(config, registry.backends[config.backend].obj(config),
                  registry.schedulers[config.scheduler].obj,
                  registry.cache_policy_for(config.backend, config.cache_policy),
                  replica_id=replica_id)


def loaded_of(engine: Engine) -> Loaded:
    """The ``("loaded", ...)`` message's body for a loaded engine."""
    return Loaded(
        info=info_of(engine),
        supports_embeddings=engine.backend.supports_embeddings and engine.config.embeddings,
        runtime=engine.runtime(), state=LocalEngineClient(engine).state(), pid=os.getpid())


def main(fd: int) -> int:
    from laya_core.logs import setup_logging

    setup_logging()
    # The front end decides when this replica stops (it drains its requests first); a
    # terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start_named(threading.main_thread(), "laya-worker")  # its event loop's thread
    conn = Connection(fd)
    link = _Link(conn)
    start_named(threading.Thread(target=_heartbeat, args=(link,),
                                 name="laya-worker-heartbeat", daemon=True), "laya-heartbeat")
    _, config, replica_id, plugins = conn.recv()
    assert isinstance(config, ModelConfig)
    engine = build_engine(config, replica_id, plugins)
    engine.start()
    if not engine.wait_ready():
        link.send(("failed", engine.error or engine.state.value))
        return 1
    link.send(("loaded", loaded_of(engine)))
    link.state = LocalEngineClient(engine).state

    def started(worker: _Worker) -> None:
        start_named(threading.Thread(target=_read, args=(conn, worker),
                                     name="laya-worker-reader", daemon=True), "laya-reader")

    try:
        asyncio.run(serve_engine(engine, link.send, started, heartbeat=False))
    finally:
        engine.stop()
    return 0 if engine.state is not EngineState.FAILED else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
