"""The front end's side of a replica in a worker process: spawn, talk, supervise, restart.

:class:`WorkerEngineClient` is an :class:`~laya_core.client.EngineClient` whose engine runs
in ``python -m laya_core.worker`` (the protocol is in :mod:`laya_core.worker`). A thread per
replica supervises it: it starts the process, reads its messages (a step's events come in
one message and reach each event loop in one ``call_soon_threadsafe``), and when the
process dies (``kill -9``, a native crash) it ends that replica's requests at once with an
error that says so (the HTTP side answers 503 with Retry-After, or an error event in a
stream), marks the replica down in the router (``on_change``), and starts it again after
a backoff. A worker that dies while loading :data:`MAX_LOAD_CRASHES` times in a row is left
down, FAILED, with its last output in the error. One that fails to load with a Python
error (a bad file, an option the backend refuses) fails at once, as an in-process replica
does: a restart would fail the same way.

The tokenizer stays in the front end (``Backend.load_tokenizer``: the vocabulary without
the weights), so prompts are tokenized on the HTTP side's worker threads as before, and
the chat template is probed here once the worker has loaded.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs

from laya_core.backend import Backend, ModelConfig
from laya_core.client import (
    EngineClient,
    EngineState,
    EngineUnavailableError,
    GrammarError,
    QueueFullError,
    ReplicaInfo,
    ReplicaState,
    RequestTooLongError,
)
from laya_core.embeddings import Embeddings, EmbeddingsUnsupportedError
from laya_core.logs import resident_bytes
from laya_core.stream import GenerationStream, deliver
from laya_core.structured.spec import ConstraintSpec
from laya_core.tokenizer import Tokenizer
from laya_core.types import FinishReason, SamplingParams, TokenEvent
from laya_core.worker import Loaded

log = logging.getLogger(__name__)
MAX_LOAD_CRASHES = 3
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# A worker that served this long before it died starts again without waiting.
STABLE_S = 60.0
_OUTPUT_LINES = 30


def too_long(model: str, num_prompt_tokens: int, max_tokens: int, max_seq_len: int) -> str | None:
    """Why a request can never fit one sequence of the replica, or None (the engine's rule)."""
    if num_prompt_tokens + max_tokens <= max_seq_len:
        return None
    return (f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} tokens in all, more than this model's "
            f"max_seq_len of {max_seq_len}; shorten the prompt or lower max_tokens")


def _died(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@attrs.define
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: Any  # the stream's asyncio.Queue
    ack: asyncio.Future[Any] | None


class WorkerEngineClient(EngineClient):
    """One replica in a worker process; see the module docstring."""

    def __init__(self, config: ModelConfig, replica_id: int, backend: Backend,
                 plugins: Sequence[str] = (),
                 on_change: Callable[[WorkerEngineClient], None] | None = None,
                 on_loaded: Callable[[WorkerEngineClient], None] | None = None) -> None:
        super().__init__(config.name, replica_id)
        self.config = config
        self._backend = backend  # unloaded: only its load_tokenizer is used here
        self._plugins = list(plugins)
        self._on_change = on_change
        self._on_loaded = on_loaded  # the front end's check of the loaded model
        self._state = EngineState.LOADING
        self._error: str | None = None
        self._loaded: Loaded | None = None
        self._info: ReplicaInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._snapshot: ReplicaState | None = None
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _requests and _embeds
        self._requests: dict[int, _Request] = {}
        self._embeds: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self.output: collections.deque[str] = collections.deque(maxlen=_OUTPUT_LINES)
        self.restarts = 0
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name=f"laya-worker-{config.name}-{replica_id}")

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first load ended (ready or failed); whether it is ready."""
        self._ready.wait(timeout)
        return self._state is EngineState.READY

    def begin_stop(self) -> None:
        """Ask the worker to stop, without waiting (stop() waits): a deployment asks all
        of its workers first, so they stop together."""
        self._stopping.set()
        self._send(("stop",))

    def stop(self, timeout: float = 10.0) -> None:
        self.begin_stop()
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._thread.join(timeout)
        if self._tokenizer is not None and hasattr(self._tokenizer, "close"):
            self._tokenizer.close()
        self._state = EngineState.STOPPED

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def resident_bytes(self) -> int | None:
        """The worker process's resident set size now, or None (not running, not Linux)."""
        return resident_bytes(self.pid) if self.pid is not None else None

    # -- EngineClient -----------------------------------------------------------------------

    def state(self) -> ReplicaState:
        snap = self._snapshot
        if snap is None or self._state is not EngineState.READY:
            running = 0 if snap is None else snap.num_running
            return ReplicaState(
                model=self.model, replica_id=self.replica_id, state=self._state,
                error=self._error, num_running=running, num_waiting=0,
                kv_capacity_tokens=snap.kv_capacity_tokens if snap else 0, kv_used_tokens=0,
                kv_cached_tokens=0, prefix_queried_tokens=0, prefix_tokens_reused=0,
                prefix_hits=0, finished={}, rejections={})
        return attrs.evolve(snap, state=self._state, error=self._error)

    def info(self) -> ReplicaInfo:
        if self._info is None:
            raise EngineUnavailableError(
                f"{self.model} replica {self.replica_id} is {self._state.value}")
        return self._info

    def tokenizer(self) -> Tokenizer:
        self.info()
        assert self._tokenizer is not None
        return self._tokenizer

    def runtime(self) -> dict[str, Any]:
        loaded = self._loaded
        out = dict(loaded.runtime) if loaded else {}
        out.update({"process": "worker", "pid": self.pid, "restarts": self.restarts})
        return out

    def supports_embeddings(self) -> bool:
        return self._loaded is not None and self._loaded.supports_embeddings

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        if self._state is not EngineState.READY:
            raise EngineUnavailableError(
                f"{self.model} replica {self.replica_id} is {self._state.value}")
        info = self.info()
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        if params.prompt_logprobs is not None and not info.supports_prompt_logprobs:
            raise ValueError(f"the {info.backend_name} backend cannot compute prompt "
                             "log-probabilities")
        why = too_long(self.model, len(prompt_token_ids), params.max_tokens, info.max_seq_len)
        if why:
            raise RequestTooLongError(why)
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        stream = GenerationStream(rid, len(prompt_token_ids), self.cancel)
        ack: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._requests[rid] = _Request(loop, stream.queue, ack)
        if not self._send(("submit", rid, list(prompt_token_ids), params, constraint)):
            self._forget(rid)
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} is down")
        try:
            refusal = await ack
        except BaseException:
            self.cancel(rid)
            self._forget(rid)
            raise
        if refusal is not None:
            self._forget(rid)
            kind, message, param = refusal
            raise {"too_long": RequestTooLongError, "queue_full": QueueFullError,
                   "unavailable": EngineUnavailableError}.get(kind, ValueError)(message) \
                if kind != "grammar" else GrammarError(param, message)
        return stream

    def cancel(self, request_id: int) -> None:
        self._send(("cancel", request_id))

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        if self._state is not EngineState.READY:
            raise EngineUnavailableError(
                f"{self.model} replica {self.replica_id} is {self._state.value}")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._embeds[rid] = (loop, future)
        if not self._send(("embed", rid, [list(i) for i in inputs])):
            with self._lock:
                self._embeds.pop(rid, None)
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} is down")
        result, kind, message = await future
        if kind is not None:
            raise {"RequestTooLongError": RequestTooLongError,
                   "QueueFullError": QueueFullError,
                   "EmbeddingsUnsupportedError": EmbeddingsUnsupportedError,
                   "EngineUnavailableError": EngineUnavailableError}.get(
                       kind, ValueError)(message)
        assert isinstance(result, Embeddings)
        return result

    # -- the connection ---------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(message)
            return True
        except OSError:
            return False

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._requests.pop(rid, None)

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "events":
            batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, TokenEvent]]] = {}
            with self._lock:
                for rid, event in message[1]:
                    request = self._requests.get(rid)
                    if request is None:
                        continue
                    batches.setdefault(request.loop, []).append((request.queue, event))
                    if event.finish_reason is not None:
                        del self._requests[rid]
            self._snapshot = message[2]
            for loop, items in batches.items():
                _call(loop, deliver, items)
        elif kind in ("ack", "refused"):
            with self._lock:
                request = self._requests.get(message[1])
            if request is not None and request.ack is not None:
                _call(request.loop, _resolve, request.ack,
                      None if kind == "ack" else tuple(message[2:]))
                request.ack = None
        elif kind == "embedded":
            with self._lock:
                found = self._embeds.pop(message[1], None)
            if found is not None:
                _call(found[0], _resolve, found[1], tuple(message[2:]))
        elif kind == "state":
            self._snapshot = message[1]

    def _lose_all(self, why: str) -> None:
        """End every request of a worker that died, with the reason."""
        with self._lock:
            requests, self._requests = self._requests, {}
            embeds, self._embeds = self._embeds, {}
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, TokenEvent]]] = {}
        lost = TokenEvent("", (), FinishReason.ERROR, error=why, replica_lost=True)
        for request in requests.values():
            if request.ack is not None:
                _call(request.loop, _fail, request.ack, EngineUnavailableError(why))
            batches.setdefault(request.loop, []).append((request.queue, lost))
        for loop, items in batches.items():
            _call(loop, deliver, items)
        for loop, future in embeds.values():
            _call(loop, _fail, future, EngineUnavailableError(why))

    # -- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        crashes = 0  # deaths while loading, in a row
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                outcome = self._run_once()
            except Exception as e:  # noqa: BLE001 - a broken exchange is a failed worker
                log.exception("%s replica %d: its worker failed", self.model, self.replica_id)
                self._kill()
                self._conn = None
                self._error = f"its worker process failed: {type(e).__name__}: {e}"
                self._set_state(EngineState.LOADING)
                self._lose_all(self._error)
                outcome = "crashed_loading" if self._info is None else "died"
            if self._stopping.is_set():
                break
            if outcome == "failed":  # a Python-level load error: a restart would repeat it
                break
            crashes = crashes + 1 if outcome == "crashed_loading" else 0
            if crashes >= MAX_LOAD_CRASHES:
                self._error = (f"the worker process died while loading {crashes} times in "
                               f"a row ({self._error}); left down. Its last output:\n"
                               + "\n".join(self.output))
                self._set_state(EngineState.FAILED)
                log.error("%s replica %d: %s", self.model, self.replica_id, self._error)
                break
            served = time.monotonic() - started
            wait = 0.0 if served >= STABLE_S else BACKOFF_S[min(crashes, len(BACKOFF_S) - 1)]
            self.restarts += 1
            log.warning("%s replica %d: restarting its worker in %.1f s", self.model,
                        self.replica_id, wait)
            if self._stopping.wait(wait):
                break
        self._ready.set()

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(self)

    def _run_once(self) -> str:
        """Start the worker and serve it until it ends: "failed" (its load raised),
        "crashed_loading", "died" (after it had loaded) or "stopped"."""
        front, back = socket.socketpair()
        env = dict(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-m", "laya_core.worker", str(back.fileno())],
            pass_fds=(back.fileno(),), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
            env=env)
        back.close()
        self._proc = proc
        threading.Thread(target=self._relay_output, args=(proc,), daemon=True,
                         name=f"laya-worker-output-{self.replica_id}").start()
        conn = Connection(front.detach())
        try:
            conn.send(("init", self.config, self.replica_id, self._plugins))
            first = conn.recv()
        except (EOFError, OSError):
            code = proc.wait()
            self._error = f"its worker process {_died(code)} while loading"
            self._set_state(EngineState.LOADING)
            conn.close()
            return "crashed_loading"
        if first[0] == "failed":
            self._error = first[1]
            self._set_state(EngineState.FAILED)
            conn.close()
            proc.wait()
            return "failed"
        self._loaded = loaded = first[1]
        try:
            self._front_loaded(loaded)
        except Exception as e:  # noqa: BLE001 - the front end's check refused the model
            self._error = f"{type(e).__name__}: {e}"  # as an engine says a failed load
            self._set_state(EngineState.FAILED)
            conn.send(("stop",))
            conn.close()
            proc.wait()
            return "failed"
        self._conn = conn
        self._snapshot = loaded.state
        self._error = None
        self._set_state(EngineState.READY)
        self._ready.set()
        try:
            while True:
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            pass
        self._conn = None
        conn.close()
        code = proc.wait()
        if self._stopping.is_set():
            self._lose_all(f"{self.model} replica {self.replica_id} stopped")
            return "stopped"
        why = (f"the worker process of {self.model} replica {self.replica_id} "
               f"{_died(code)}; retry")
        self._error = why
        self._set_state(EngineState.LOADING)
        self._lose_all(why)
        log.error("%s", why)
        return "died"

    def _front_loaded(self, loaded: Loaded) -> None:
        """The front end's half of a load: its tokenizer (once) and the replica's info."""
        if self._tokenizer is None:
            tokenizer = self._backend.load_tokenizer()
            if tokenizer is None:
                raise RuntimeError(f"the {loaded.backend_name} backend cannot load its "
                                   "tokenizer apart from its weights")
            self._tokenizer = tokenizer
        self._info = ReplicaInfo(
            model=self.model, replica_id=self.replica_id, backend_name=loaded.backend_name,
            max_seq_len=loaded.max_seq_len, max_queue=loaded.max_queue,
            supports_prompt_logprobs=loaded.supports_prompt_logprobs,
            model_info=loaded.model_info, backend_embeds=loaded.backend_embeds)
        if self._on_loaded is not None:
            self._on_loaded(self)

    def _relay_output(self, proc: subprocess.Popen[bytes]) -> None:
        """The worker's stderr to this process's, line by line, keeping the last lines."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.output.append(line)
            sys.stderr.write(f"[{self.model}/{self.replica_id}] {line}\n")
        proc.stderr.close()


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop has closed: nobody waits for these any more
        pass


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
