"""The front end's side of a replica in a worker process: spawn, talk, supervise, restart.

:class:`WorkerEngineClient` is an :class:`~laya_core.replica.client.EngineClient` whose engine runs
in ``python -m laya_core.replica.worker`` (the messages are :mod:`laya_core.replica.protocol`'s). A thread per
replica supervises it: it starts the process, reads its messages (a step's events come in
one message and reach each event loop in one ``call_soon_threadsafe``), and when the
process dies (``kill -9``, a native crash) it ends that replica's requests at once with an
error that says so (the HTTP side answers 503 with Retry-After, or an error event in a
stream), marks the replica down in the router (``on_change``), and starts it again after
a backoff. A worker that stops answering (``SIGSTOP``, a wedged process: no step and no
heartbeat for ``silence_s``) is killed and then handled as one that died
(:mod:`laya_core.replica.worker_link`, which also keeps sends from ever waiting on the socket).
When to restart it, and when to leave it down (it died while loading
:data:`~laya_core.replica.supervisor.MAX_LOAD_CRASHES` times in a row: FAILED, with its last
output in the error) is :mod:`laya_core.replica.supervisor`'s, shared with the Ray actor.

The tokenizer stays in the front end (``Backend.load_tokenizer``: the vocabulary without
the weights), so prompts are tokenized on the HTTP side's worker threads as before, and
the chat template is probed here once the worker has loaded.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from laya_core.backend import Backend, ModelConfig
from laya_core.engine.layer_clock import IPC_RECEIVE
from laya_core.logs import resident_bytes, start_named
from laya_core.replica.child_exit import describe_exit
from laya_core.replica.client import EngineState
from laya_core.replica.remote import RemoteEngineClient
from laya_core.replica.supervisor import Outcome
from laya_core.replica.worker_link import DEFAULT_SILENCE_S, WorkerLink

log = logging.getLogger(__name__)
_OUTPUT_LINES = 30


def _died(code: int | None) -> str:
    return describe_exit(code, "closed its connection")


class WorkerEngineClient(RemoteEngineClient):
    """One replica in a worker process; see the module docstring."""

    kind = "worker"
    child = "worker process"

    def __init__(self, config: ModelConfig, replica_id: int, backend: Backend,
                 plugins: Sequence[str] = (),
                 on_change: Callable[[WorkerEngineClient], None] | None = None,
                 on_loaded: Callable[[WorkerEngineClient], None] | None = None,
                 silence_s: float = DEFAULT_SILENCE_S) -> None:
        super().__init__(config, replica_id, backend, plugins, on_change, on_loaded)
        self.silence_s = silence_s  # a worker silent this long is killed as stuck
        self._link: WorkerLink | None = None  # while the worker serves
        self._proc: subprocess.Popen[bytes] | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=_OUTPUT_LINES)

    # -- lifecycle --------------------------------------------------------------------------

    def begin_stop(self) -> None:
        """Ask the worker to stop, without waiting (stop() waits): a deployment asks all
        of its workers first, so they stop together."""
        self._stopping.set()
        self._send(("stop",))

    def stop(self, timeout: float = 10.0) -> None:
        self.begin_stop()
        proc = self._proc
        if proc is not None:
            try:  # one still loading has nothing to finish, and reads no "stop"
                proc.wait(timeout if self._link is not None else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._thread.join(timeout)
        self._close_tokenizer()
        self._state = EngineState.STOPPED

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def resident_bytes(self) -> int | None:
        """The worker process's resident set size now, or None (not running, not Linux)."""
        return resident_bytes(self.pid) if self.pid is not None else None

    def runtime(self) -> dict[str, Any]:
        loaded = self._loaded
        out = dict(loaded.runtime) if loaded else {}
        out.update({"process": "worker", "pid": self.pid, "restarts": self.restarts})
        return out

    # -- the connection ---------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> bool:
        link = self._link
        return link is not None and link.send(message)

    # -- supervision ------------------------------------------------------------------------

    def _run_once(self) -> Outcome:
        try:
            return self._start_and_serve()
        except Exception as e:  # noqa: BLE001 - a broken exchange is a failed worker
            log.exception("%s replica %d: its worker failed", self.model, self.replica_id)
            self._kill()
            self._link = None
            self._error = f"its worker process failed: {type(e).__name__}: {e}"
            self._set_state(EngineState.LOADING)
            self._lose_all(self._error)
            return Outcome.CRASHED_LOADING if self._info is None else Outcome.DIED

    def _last_words(self) -> str:
        return ". Its last output:\n" + "\n".join(self.output)

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def _start_and_serve(self) -> Outcome:
        """Start the worker and serve it until it ends."""
        front, back = socket.socketpair()
        env = dict(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-m", "laya_core.replica.worker", str(back.fileno())],
            pass_fds=(back.fileno(),), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
            env=env)
        back.close()
        self._proc = proc
        start_named(threading.Thread(target=self._relay_output, args=(proc,), daemon=True,
                                     name=f"laya-worker-output-{self.replica_id}"), "laya-relay")
        link = WorkerLink(Connection(front.detach()), proc, self.silence_s,
                          f"{self.model}-{self.replica_id}")
        try:
            return self._serve(link, proc)
        finally:
            link.close()

    def _serve(self, link: WorkerLink, proc: subprocess.Popen[bytes]) -> Outcome:
        """Load the worker and dispatch its messages until it ends."""
        try:
            link.send(("init", self.config, self.replica_id, self._plugins))
            first = link.recv()
            while first[0] == "beat":  # the heartbeat while it loads
                first = link.recv()
        except (EOFError, OSError):
            code = proc.wait()
            self._error = f"its worker process {link.stuck or _died(code)} while loading"
            self._set_state(EngineState.LOADING)
            return Outcome.CRASHED_LOADING
        if first[0] == "failed":
            self._error = first[1]
            self._set_state(EngineState.FAILED)
            proc.wait()
            return Outcome.FAILED
        self._loaded = loaded = first[1]
        try:
            self._front_loaded(loaded)
        except Exception as e:  # noqa: BLE001 - the front end's check refused the model
            self._error = f"{type(e).__name__}: {e}"  # as an engine says a failed load
            self._set_state(EngineState.FAILED)
            link.close()  # the worker stops when its socket closes
            proc.wait()
            return Outcome.FAILED
        self._link = link
        self._snapshot = loaded.state
        self._error = None
        self._set_state(EngineState.READY)
        self._ready.set()
        try:
            while True:
                self._dispatch(link.recv())
                self.clock.add(IPC_RECEIVE, link.received_ns)  # unpickle and dispatch
        except (EOFError, OSError):
            pass
        self._link = None
        link.close()  # what was queued for the worker goes with it
        code = proc.wait()
        return self._ended(f"the worker process of {self.model} replica {self.replica_id} "
                           f"{link.stuck or _died(code)}; retry", log)

    def _relay_output(self, proc: subprocess.Popen[bytes]) -> None:
        """The worker's stderr to this process's, line by line, keeping the last lines."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.output.append(line)
            sys.stderr.write(f"[{self.model}/{self.replica_id}] {line}\n")
        proc.stderr.close()


