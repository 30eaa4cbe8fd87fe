"""Engine-level backends: a backend that owns its scheduling and cache serves each replica
through an :class:`~laya_core.replica.client.EngineClient` of its own.

A step-level backend (:class:`~laya_core.backend.Backend`) runs one batched forward pass
per step and the core does the rest. A serving library with its own queue and paged cache
(exllamav2's dynamic generator, vLLM's engine) or another server reached over HTTP cannot be
driven step by step; it plugs in one level up, behind the same seam the worker processes
and Ray actors use. It is registered as any backend is (``register_backends``), so the
manifest, ``laya check``, ``laya plan``, the router, the HTTP API, its validation and
limits, ``/ready`` and ``/metrics`` treat it as they treat the others; only the replica's
inside is the backend's:

- :class:`EngineBackend` is the class the manifest names (``kind = "engine"``). It declares
  options, model paths and the memory profile as every backend does, and
  :meth:`EngineBackend.engine_client` makes one replica's client.
- :class:`EngineBackendClient` is that client's base: it runs the replica's lifecycle on a
  thread of its own (``load`` until it succeeds, then ``check`` every
  ``health_interval_s``; a failure marks the replica down, so the router sends its requests
  to the others, and the next success brings it back), admits requests within the
  manifest's limits (:meth:`EngineBackendClient.wait_for_room`), keeps the counters
  ``/ready`` and ``/metrics`` read, and leaves ``submit``, ``cancel`` and the tokenizer to
  the backend.

The manifest's limits hold as they do for a step-level model: at most ``max_num_seqs``
requests run on a replica at once (unset: ``default_max_running``, None for as many as the
engine takes, whose own queue or refusals then decide), at most ``max_queue`` more wait for
a place, in arrival order, one more is refused with 429 ``queue_full``, and one that waited
``queue_timeout_s`` gets 503 ``queue_timeout``. The wait shows as the request's queue time.

The HTTP side still hands ``submit`` token ids: a backend whose server takes text gives the
front end a tokenizer whose ids are the text's UTF-8 bytes, and decodes them back
(``examples/laya-backend-openai`` does, and renders a chat as JSON its server reads).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from laya_core.backend import Backend, ModelInfo, StepItem, StepResult
from laya_core.engine.stream import GenerationStream
from laya_core.logs import start_named
from laya_core.replica.client import (
    EngineClient,
    EngineState,
    EngineUnavailableError,
    QueueFullError,
    QueueTimeoutError,
    ReplicaInfo,
    ReplicaSnapshot,
)
from laya_core.types import FinishReason, SamplingParams

__all__ = ["EngineBackend", "EngineBackendClient"]

log = logging.getLogger(__name__)


def _grant(place: asyncio.Future[None]) -> None:
    if not place.done():
        place.set_result(None)


class EngineBackend(Backend):
    """A backend that owns its scheduling and cache; see the module docstring.

    The step-level methods are never called: the core builds no engine for its replicas,
    no scheduler and no cache policy (``kv_layout`` stays "paged" only so that the
    manifest's ``cache_policy = "auto"`` resolves). ``memory_profile`` is what one replica
    holds on this machine: the default counts the shape's ``weights_bytes`` and its KV at
    ``kv_cache_dtype``; a backend whose cache lives elsewhere reports a shape without
    layers (KV 0), one with a local cache reports that cache."""

    kind: ClassVar[str] = "engine"
    kv_layout: ClassVar[str] = "paged"
    # Constraints reach ``submit`` as a ConstraintSpec; one that compiles them with
    # laya_core.structured's GrammarCompiler (to mask its engine's sampling) says True.
    supports_constraints: ClassVar[bool] = False

    @abc.abstractmethod
    def engine_client(self, replica_id: int, index: int) -> EngineBackendClient:
        """The client of the deployment's replica ``replica_id``, the model's ``index``-th
        (0 .. ``config.replicas`` - 1), not started: the deployment binds its callbacks,
        starts it and stops it."""

    def load_weights(self) -> ModelInfo:
        raise NotImplementedError(f"the {self.name} backend is engine-level: no steps")

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        raise NotImplementedError(f"the {self.name} backend is engine-level: no steps")

    def tokenizer(self) -> Any:
        raise NotImplementedError(f"the {self.name} backend is engine-level: its client's "
                                  "tokenizer() is the one the front end uses")

    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        raise NotImplementedError(f"the {self.name} backend is engine-level: no steps")

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        raise NotImplementedError(f"the {self.name} backend is engine-level: no steps")

    def free_sequence(self, seq_id: int) -> None:
        raise NotImplementedError(f"the {self.name} backend is engine-level: no steps")


class EngineBackendClient(EngineClient):
    """One replica of an engine-level backend; see the module docstring.

    A subclass implements ``load`` (reach the engine or server, return what it serves),
    ``tokenizer``, ``submit`` and ``cancel``, and may override ``check`` (the health check;
    the default loads again) and ``close``. ``submit`` runs on the event loop: it checks the
    request, awaits :meth:`wait_for_room` (a place among the replica's running requests),
    makes a stream with :meth:`new_stream`, puts ``ADMITTED`` (``laya_core.engine.stream``)
    on it once the request runs and then :class:`~laya_core.types.TokenEvent` objects, the
    last with its finish reason, ``Usage`` and ``Timing``. Each place taken is given back
    once: :meth:`count_finished` when the request ran, :meth:`give_back_room` when it did
    not (the engine refused it). It calls :meth:`mark_down` when the engine is lost (its
    requests then end with ``replica_lost`` events: an error event mid-stream, a 503 with
    Retry-After before one)."""

    health_interval_s: float = 2.0
    # Requests a replica runs at once when the manifest sets no max_num_seqs; None: as
    # many as the engine takes.
    default_max_running: int | None = None

    def __init__(self, config: Any, replica_id: int) -> None:
        super().__init__(config.name, replica_id)
        self.config = config
        self._state = EngineState.LOADING
        self._error: str | None = None
        self._info: ReplicaInfo | None = None
        self._on_change: Callable[[Any], None] | None = None
        self._on_loaded: Callable[[Any], None] | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()  # guards the counters
        self.restarts = 0  # times the replica came back after it was marked down
        self._running = 0  # places taken (wait_for_room) and not yet given back
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._generated = 0
        self._finished: collections.Counter[FinishReason] = collections.Counter()
        self._rejections: collections.Counter[str] = collections.Counter()
        self._layers: dict[str, float] = collections.defaultdict(float)
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name=f"laya-engine-{config.name}-{replica_id}")

    # -- what a subclass implements ----------------------------------------------------------

    @abc.abstractmethod
    def load(self) -> ReplicaInfo:
        """Reach the engine (load it, or connect to the server) and return what it serves
        (:meth:`replica_info` builds it). Runs on the replica's own thread; raising leaves the
        replica loading, with the error in ``/ready``, and it is tried again."""

    def check(self) -> None:
        """Raise when the engine cannot serve; runs on the replica's thread every
        ``health_interval_s`` while it is up. The default loads again."""
        self.load()

    def close(self) -> None:
        """Release what the client holds; called once, when the replica stops."""

    # -- helpers for a subclass ---------------------------------------------------------------

    def replica_info(self, model_info: ModelInfo, max_seq_len: int, backend_name: str,
                     supports_prompt_logprobs: bool = False) -> ReplicaInfo:
        """The :class:`ReplicaInfo` of this replica with the manifest's queue bound."""
        return ReplicaInfo(
            model=self.model, replica_id=self.replica_id, backend_name=backend_name,
            max_seq_len=max_seq_len, max_queue=self.config.max_queue,
            supports_prompt_logprobs=supports_prompt_logprobs, model_info=model_info)

    def new_stream(self, request_id: int, num_prompt_tokens: int) -> GenerationStream:
        """A request's stream; its ``cancel()`` calls this client's ``cancel``."""
        return GenerationStream(request_id, num_prompt_tokens, self.cancel)

    def max_running(self) -> int | None:
        """Requests this replica runs at once; None: no limit of Laya's."""
        return self.config.max_num_seqs or self.default_max_running

    async def wait_for_room(self) -> float:
        """Take a place among the replica's running requests, waiting in arrival order behind
        at most ``max_queue`` others for up to ``queue_timeout_s``; the seconds waited.

        Raises :class:`QueueFullError` (429) when the queue is full or ``max_queue`` is 0
        and no place is free, :class:`QueueTimeoutError` (503) when the wait ran out. A
        request cancelled while it waits leaves the queue."""
        limit = self.max_running()
        with self._lock:
            if limit is None or (self._running < limit and not self._waiters):
                self._running += 1
                return 0.0
            if len(self._waiters) >= self.config.max_queue:
                self._rejections["queue_full"] += 1
                raise QueueFullError(
                    f"{self.model} replica {self.replica_id} runs {limit} requests "
                    f"(max_num_seqs) and {len(self._waiters)} wait (max_queue "
                    f"{self.config.max_queue})")
            place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(place)
        start = time.perf_counter()
        try:
            await asyncio.wait_for(place, self.config.queue_timeout_s)
        except TimeoutError:
            with self._lock:
                handed = place not in self._waiters  # a place came as the wait ran out
                if not handed:
                    self._waiters.remove(place)
                    self._rejections["queue_timeout"] += 1
            if not handed:
                raise QueueTimeoutError(
                    f"waited {self.config.queue_timeout_s:g} s for one of {limit} places "
                    f"(max_num_seqs) on {self.model} replica {self.replica_id}") from None
        except BaseException:  # cancelled: leave the queue, or pass on a place just handed
            with self._lock:
                handed = place not in self._waiters
                if not handed:
                    self._waiters.remove(place)
            if handed:
                self.give_back_room()
            raise
        return time.perf_counter() - start

    def give_back_room(self) -> None:
        """Return a place :meth:`wait_for_room` took for a request that did not run: the
        first in line takes it. (:meth:`count_finished` returns a finished request's.)"""
        with self._lock:
            if self._waiters:  # handed on: the count of places taken stays
                place = self._waiters.popleft()
            else:
                self._running -= 1
                return
        place.get_loop().call_soon_threadsafe(_grant, place)

    def count_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        """A request that took a place finished (for any reason); it gives the place back."""
        with self._lock:
            self._finished[reason] += 1
            self._generated += completion_tokens
        self.give_back_room()

    def count_rejected(self, reason: str) -> None:
        with self._lock:
            self._rejections[reason] += 1

    def add_layer_seconds(self, layer: str, seconds: float) -> None:
        """Time spent in a layer of the backend's own (``/metrics``'
        ``laya:engine_layer_seconds_total{layer}``)."""
        with self._lock:
            self._layers[layer] += seconds

    def mark_down(self, why: str) -> None:
        """The engine is lost (a request found it gone, or the health check failed): the
        router stops sending it requests until ``load`` succeeds again."""
        if self._state is EngineState.READY:
            log.error("%s replica %d is down: %s", self.model, self.replica_id, why)
            self._error = why
            self._set_state(EngineState.LOADING)

    # -- lifecycle (the deployment's) ---------------------------------------------------------

    def bind(self, on_change: Callable[[Any], None] | None,
             on_loaded: Callable[[Any], None] | None) -> None:
        """The deployment's callbacks: a state change (the router's view), a load done."""
        self._on_change = on_change
        self._on_loaded = on_loaded

    def start(self) -> None:
        start_named(self._thread, "laya-engine-bk")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first load was tried; whether the replica is ready."""
        self._ready.wait(timeout)
        return self._state is EngineState.READY

    def begin_stop(self) -> None:
        self._stopping.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._state = EngineState.STOPPED
        self.close()

    def resident_bytes(self) -> int | None:
        return None

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(self)

    def _watch(self) -> None:
        self._set_state(EngineState.LOADING)  # the router: down until the first load
        was_up = False
        while not self._stopping.is_set():
            if self._state is EngineState.READY:
                try:
                    self.check()
                except Exception as e:  # noqa: BLE001 - any failure means down
                    self.mark_down(f"health check failed: {e}")
            else:
                try:
                    self._info = self.load()
                    if self._on_loaded is not None:
                        self._on_loaded(self)
                except Exception as e:  # noqa: BLE001 - said in /ready, tried again
                    self._error = f"{self.model} replica {self.replica_id}: {e}"
                else:
                    self._error = None
                    if was_up:
                        self.restarts += 1
                    was_up = True
                    self._set_state(EngineState.READY)
                self._ready.set()
            self._stopping.wait(self.health_interval_s)

    # -- EngineClient -------------------------------------------------------------------------

    def state(self) -> ReplicaSnapshot:
        with self._lock:
            return ReplicaSnapshot(
                model=self.model, replica_id=self.replica_id, state=self._state,
                error=self._error, num_running=self._running,
                num_waiting=len(self._waiters),
                kv_capacity_tokens=0, kv_used_tokens=0, kv_cached_tokens=0,
                prefix_queried_tokens=0, prefix_tokens_reused=0, prefix_hits=0,
                finished=dict(self._finished), rejections=dict(self._rejections),
                generated_tokens=self._generated, layer_seconds=dict(self._layers))

    def info(self) -> ReplicaInfo:
        # Once loaded, what it serves stays known while it is down (running requests ask).
        if self._info is None:
            raise EngineUnavailableError(
                f"{self.model} replica {self.replica_id} is {self._state.value}"
                + (f": {self._error}" if self._error else ""))
        return self._info
