"""What a replica's front end holds whatever carries its messages: a worker process
(:mod:`laya_core.replica.worker_client`) or a Ray actor (:mod:`laya_core.replica.ray_client`).

:class:`RemoteEngineClient` is an :class:`~laya_core.replica.client.EngineClient` whose engine runs
elsewhere and speaks :mod:`laya_core.replica.protocol`. It keeps the request table, checks
a request as the engine would before sending it, turns acks, refusals and each step's
events into the streams' events (one ``call_soon_threadsafe`` per event loop and message),
and ends every request at once when the replica is lost. A subclass supplies ``_send``
(False when the message cannot leave; it must never wait on the replica, since the event
loop calls it: a stopped replica stops reading), ``_run_once`` (one run of its child, under
:func:`laya_core.replica.supervisor.supervise` on a thread of its own), and ``runtime``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from laya_core.backend import Backend, ModelConfig
from laya_core.engine.embed_jobs import Embeddings
from laya_core.engine.limits import check_length
from laya_core.engine.stream import GenerationStream, deliver
from laya_core.logs import start_named
from laya_core.models.tokenizer import Tokenizer
from laya_core.replica.client import (
    EngineClient,
    EngineState,
    EngineUnavailableError,
    ReplicaInfo,
    ReplicaSnapshot,
)
from laya_core.replica.protocol import Loaded, refused
from laya_core.replica.supervisor import Outcome, backoff_s, supervise
from laya_core.structured.spec import ConstraintSpec
from laya_core.types import FinishReason, SamplingParams, TokenEvent


@attrs.define
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: Any  # the stream's asyncio.Queue
    ack: asyncio.Future[Any] | None


class RemoteEngineClient(EngineClient):
    """One replica whose engine runs elsewhere; see the module docstring."""

    def __init__(self, config: ModelConfig, replica_id: int, backend: Backend,
                 plugins: Sequence[str] = (),
                 on_change: Callable[[Any], None] | None = None,
                 on_loaded: Callable[[Any], None] | None = None) -> None:
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
        self._snapshot: ReplicaSnapshot | None = None
        self._lock = threading.Lock()  # guards _requests and _embeds
        self._requests: dict[int, _Request] = {}
        self._embeds: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self.restarts = 0
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name=f"laya-{self.kind}-{config.name}-{replica_id}")

    kind = "remote"  # names the supervising thread, and the child in the restart log line
    child = "child"  # the child in errors: "worker process", "Ray actor"
    restarts_itself = False  # whether the child comes back by itself (Ray: max_restarts)

    def start(self) -> None:
        start_named(self._thread, "laya-supervisor")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first load ended (ready or failed); whether it is ready."""
        self._ready.wait(timeout)
        return self._state is EngineState.READY

    def resident_bytes(self) -> int | None:
        """The replica's resident set size now, where this machine can see it."""
        return None

    def _close_tokenizer(self) -> None:
        if self._tokenizer is not None and hasattr(self._tokenizer, "close"):
            self._tokenizer.close()

    def begin_stop(self) -> None:
        """Ask the replica to stop, without waiting (a deployment asks all of its replicas
        first, so they stop together)."""
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the replica and wait for it."""
        raise NotImplementedError

    # -- supervision (laya_core/replica/supervisor.py) ----------------------------------------

    def _supervise(self) -> None:
        supervise(self)

    def _run_once(self) -> Outcome:
        """Run the child once: start it (or wait for it to load) and serve it until it ends."""
        raise NotImplementedError

    def _restart_wait(self, crashes: int, served_s: float) -> float:
        """Seconds to wait before the next run; see :func:`~laya_core.replica.supervisor.backoff_s`."""
        return backoff_s(crashes, served_s)

    def _last_words(self) -> str:
        """What the error of a replica left down adds after "left down"."""
        return ""

    def _left_down(self) -> None:
        """Release what a replica left down still holds."""

    def _send(self, message: tuple[Any, ...]) -> bool:
        raise NotImplementedError

    # -- EngineClient -----------------------------------------------------------------------

    def state(self) -> ReplicaSnapshot:
        snap = self._snapshot
        if snap is None or self._state is not EngineState.READY:
            running = 0 if snap is None else snap.num_running
            return ReplicaSnapshot(
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
        check_length(len(prompt_token_ids), params.max_tokens, info.max_seq_len)
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
            raise refused(*refusal)
        return stream

    def cancel(self, request_id: int) -> None:
        self._send(("cancel", request_id))

    def _ask(self, kind: str, *args: Any) -> tuple[int, asyncio.Future[Any]]:
        """Send ``(kind, rid, *args)`` and return the id and the future its answer (an
        "embedded" or "adapted" message) resolves; a lost replica fails it."""
        if self._state is not EngineState.READY:
            raise EngineUnavailableError(
                f"{self.model} replica {self.replica_id} is {self._state.value}")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._embeds[rid] = (loop, future)
        if not self._send((kind, rid, *args)):
            with self._lock:
                self._embeds.pop(rid, None)
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} is down")
        return rid, future

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        rid, future = self._ask("embed", [list(i) for i in inputs])
        try:
            result, kind, message, param = await future
        except asyncio.CancelledError:  # the caller went away: so does the replica's work
            with self._lock:
                self._embeds.pop(rid, None)
            self._send(("embed_cancel", rid))
            raise
        if kind is not None:
            raise refused(kind, message, param)
        assert isinstance(result, Embeddings)
        return result

    async def adapter(self, op: str, name: str, path: str | None = None) -> None:
        _, future = self._ask("adapter", op, name, path)
        lora, kind, message, param = await future
        if kind is not None:
            raise refused(kind, message, param)
        if lora is not None and self._loaded is not None:  # /ready says what is loaded now
            self._loaded = attrs.evolve(self._loaded, runtime={**self._loaded.runtime,
                                                               "lora": lora})

    # -- messages from the replica -----------------------------------------------------------

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
                    if request.ack is not None:
                        # The engine thread sends events, the replica's loop the ack: a
                        # request's first events may come first, and they mean accepted.
                        _call(request.loop, _resolve, request.ack, None)
                        request.ack = None
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
        elif kind in ("embedded", "adapted"):
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

    def _ended(self, why: str, log: logging.Logger) -> Outcome:
        """The child is gone: every request it held ends, with ``why`` unless this client
        was stopping. Logged on the transport's ``log``, as its other lines are."""
        if self._stopping.is_set():
            self._lose_all(f"{self.model} replica {self.replica_id} stopped")
            return Outcome.STOPPED
        self._error = why
        self._set_state(EngineState.LOADING)
        self._lose_all(why)
        if self.restarts_itself:  # the supervisor counts the restarts it makes itself
            self.restarts += 1
        log.error("%s", why)
        return Outcome.DIED

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(self)

    def _front_loaded(self, loaded: Loaded) -> None:
        """The front end's half of a load: its tokenizer (once) and the replica's info."""
        if self._tokenizer is None:
            tokenizer = self._backend.load_tokenizer()
            if tokenizer is None:
                raise RuntimeError(f"the {loaded.info.backend_name} backend cannot load its "
                                   "tokenizer apart from its weights")
            self._tokenizer = tokenizer
        self._info = loaded.info
        if self._on_loaded is not None:
            self._on_loaded(self)


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
