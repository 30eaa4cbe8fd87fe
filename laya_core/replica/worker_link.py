"""The front end's connection to one worker process: sends that never wait, and a watchdog.

A worker that stops reading (``SIGSTOP``, a frozen machine, a wedged process) fills its
socket's buffer, and a plain ``send`` then blocks its caller: when that caller is the event
loop, every request of the server waits with it. So :meth:`WorkerLink.send` pickles the
message on the caller's thread (a pickling error still reaches the caller) and queues the
bytes; one sender thread per link writes them in order. A queue and a thread rather than a
non-blocking socket with an outbox on the event loop: the client is called from any thread
and from several event loops (tests, embedding), and a thread needs no loop to drain it.
The queue holds what was submitted to the worker, as the socket's buffer did, and is
dropped with the link when the worker dies or is killed.

The watchdog kills (``SIGKILL``) a worker that has sent nothing for ``silence_s``: not a
step's events, not the heartbeat that :mod:`laya_core.replica.worker` sends every 0.25 s from a
thread of its own, from its start (while it loads too) to its end. The reader then sees it die as a crash, and the supervisor ends its
requests and restarts it. Before it kills, it checks the socket: bytes waiting there mean
the worker spoke and this process was too busy to read them, which is no fault of the
worker.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from laya_core.engine.layer_clock import now_ns
from laya_core.logs import start_named

log = logging.getLogger(__name__)
# The heartbeat comes every 0.25 s from a thread that needs the GIL for microseconds (the
# backends' model calls release it), so 10 s of silence is 40 beats missed: the process is
# stopped or wedged, not busy. Long enough for a machine under heavy load to schedule a
# thread; short enough that clients of a stuck worker get their 503 before they time out.
DEFAULT_SILENCE_S = 10.0
# Until its first word, a new worker may take longer: the interpreter's start and imports,
# on a loaded machine, come before its heartbeat thread does.
FIRST_WORD_S = 60.0


class WorkerLink:
    """One worker process's socket: queued sends, received messages, and the watchdog."""

    def __init__(self, conn: Connection, proc: subprocess.Popen[bytes], silence_s: float,
                 name: str) -> None:
        self.conn = conn
        self.proc = proc
        self.silence_s = silence_s
        self.started = time.monotonic()
        self.heard: float | None = None  # when the worker last said anything
        self.received_ns = 0  # perf_counter_ns when the last message's bytes were in
        self.stuck: str | None = None  # why the watchdog killed it
        self._outgoing: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        for target, role in ((self._write, "sender"), (self._watch, "watchdog")):
            start_named(threading.Thread(target=target, daemon=True, name=f"laya-{role}-{name}"),
                        f"laya-{role}")

    def send(self, message: tuple[Any, ...]) -> bool:
        """Queue a message for the worker; False once the link has closed. Never waits on
        the socket."""
        if self._closed.is_set():
            return False
        self._outgoing.put(ForkingPickler.dumps(message))
        return True

    def recv(self) -> Any:
        """The worker's next message (blocking; raises EOFError or OSError once it is gone)."""
        data = self.conn.recv_bytes()  # what Connection.recv does, with the wait apart
        self.received_ns = now_ns()
        self.heard = time.monotonic()
        return ForkingPickler.loads(data)

    def close(self) -> None:
        """Stop the threads and close the socket (again: a no-op)."""
        self._closed.set()
        self._outgoing.put(None)
        self.conn.close()

    def _write(self) -> None:
        while (data := self._outgoing.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except Exception:  # noqa: BLE001 - the worker died or the link closed: the
                return  # reader ends the replica and its requests

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.silence_s / 4)):
            heard = self.heard
            limit = self.silence_s if heard is not None else max(self.silence_s, FIRST_WORD_S)
            silent = time.monotonic() - (heard if heard is not None else self.started)
            if silent < limit or self._unread():
                continue
            self.stuck = (f"stopped answering (nothing for {silent:.1f} s, not even its "
                          "heartbeat) and was killed")
            if not self._closed.is_set():
                log.error("worker process %d %s", self.proc.pid, self.stuck)
                self.proc.kill()
            return

    def _unread(self) -> bool:
        """Whether bytes from the worker wait in the socket, unread by this process."""
        try:
            return self.conn.poll(0)
        except (OSError, ValueError):  # closed under us: the link is ending anyway
            return False
