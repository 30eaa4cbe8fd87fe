"""Models loaded on demand: which are resident, loading them, and unloading by the plan.

A model whose manifest entry says ``load = "on_demand"`` is not loaded with the server. Its
first request asks :meth:`Residency.ensure`, which loads it when the memory plan has room:
the runtime, the pinned models (``load = "always"``) and the on-demand models resident now,
each at its planned bytes, plus this one, within the budget. Where there is no room, the
least recently used idle on-demand models (no request running, waiting or routed to them)
are unloaded, one at a time, until there is; each unload ends with its replicas stopped
(a worker process has exited), so the sum of the resident models' plans never exceeds the
budget. When no model can be unloaded (all are busy), the load waits for room up to the
model's ``queue_timeout_s``; its requests wait with it, and get 503 with Retry-After when
the time is up.

An on-demand model with ``idle_unload_s`` is unloaded once that long has passed without a
request. Unloading never cuts a request: the model's replicas leave the router first, the
requests they hold finish, and then they stop. ``laya_core.http`` answers with
``/v1/models`` (each model's status), ``POST /models/load`` and ``POST /models/unload``.

The decisions are made under one lock, on numbers the plan made before anything loaded;
the loads and unloads themselves run on threads of their own (a load takes seconds), never
on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

log = logging.getLogger(__name__)

# How often the idle timer looks, and a waiting load looks for room again.
TICK_S = 0.1


class Status(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


class NoRoomError(RuntimeError):
    """No room could be made for the model within its wait: every resident model is busy."""


class LoadQueueFullError(RuntimeError):
    """As many requests wait for the model's load as its ``max_queue`` holds."""


class LoadFailedError(RuntimeError):
    """The model's replicas did not load; the message says why."""


class Host(Protocol):
    """What the deployment does for the residency (laya_core/serving/deployment.py)."""

    def load_model(self, name: str) -> str | None:
        """Start the model's replicas and wait until they loaded; None, or why they failed
        (they are stopped again then)."""

    def stop_model(self, name: str) -> None:
        """Stop the model's replicas and wait until they have (their processes exited)."""

    def set_routable(self, name: str, routable: bool) -> None:
        """Let the router send the model's replicas requests, or stop it doing so."""

    def busy(self, name: str) -> bool:
        """Whether a request is running on, waiting for or routed to the model's replicas."""


@attrs.define
class Resident:
    """One on-demand model's state, and what happened to it."""

    name: str
    planned_bytes: int  # all its replicas, as the plan counted them
    queue_timeout_s: float
    idle_unload_s: float | None
    max_queue: int = 64  # requests that may wait for its load; more are refused
    # What its replicas hold on each GPU, as planned ("cuda:0" -> bytes).
    gpu_bytes: Mapping[str, int] = attrs.field(factory=dict)
    status: Status = Status.UNLOADED
    last_used: float = 0.0  # time.monotonic() of its last request, or its last busy look
    in_use: int = 0  # requests between acquire() and release(): not yet on a replica
    waiting: int = 0  # requests waiting for its load
    error: str | None = None
    loads: int = 0
    unloads: collections.Counter[str] = attrs.field(factory=collections.Counter)
    load_seconds: list[float] = attrs.field(factory=list)  # each load's duration
    load: concurrent.futures.Future[None] | None = None  # the load under way

    @property
    def holds_memory(self) -> bool:
        return self.status in (Status.LOADING, Status.LOADED, Status.UNLOADING)

    def to_json(self) -> dict[str, Any]:
        # A load waiting for room is loading, as its requests see it.
        waiting = self.load is not None and self.status is Status.UNLOADED
        return {"status": Status.LOADING.value if waiting else self.status.value,
                "planned_bytes": self.planned_bytes, "error": self.error,
                "loads": self.loads, "unloads": dict(self.unloads),
                "last_load_s": self.load_seconds[-1] if self.load_seconds else None,
                "load_seconds_total": sum(self.load_seconds),
                "waiting_for_load": self.waiting,
                "idle_unload_s": self.idle_unload_s}


class Residency:
    """The on-demand models of one deployment; see the module docstring.

    ``budget_bytes`` None: no budget (a deployment built in code without a plan), so every
    load finds room and only the idle timer unloads. ``fixed_bytes``: what the runtime and
    the pinned models hold, which the on-demand ones fit beside. ``gpu_room``: by GPU, what
    its budget leaves beside the pinned models' share of it; a model fits where every
    device holds it."""

    def __init__(self, host: Host, residents: list[Resident], budget_bytes: int | None,
                 fixed_bytes: int, clock: Callable[[], float] = time.monotonic,
                 gpu_room: Mapping[str, int] | None = None) -> None:
        self.host = host
        self.residents = {r.name: r for r in residents}
        self.budget_bytes = budget_bytes
        self.fixed_bytes = fixed_bytes
        self.gpu_room = dict(gpu_room or {})
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a model unloaded or went idle
        self._stopping = threading.Event()
        self._started = False
        self._timer = threading.Thread(target=self._watch, daemon=True,
                                       name="laya-residency")

    def add(self, resident: Resident) -> None:
        """One more on-demand model (the mapping is replaced whole: others read it)."""
        with self._lock:
            self.residents = {**self.residents, resident.name: resident}
            start = self._started and not self._timer.is_alive()
        if start:
            self._timer.start()

    def start(self) -> None:
        """Start the idle timer, now or once there is an on-demand model."""
        with self._lock:
            self._started = True
            start = bool(self.residents)
        if start:
            self._timer.start()

    def stop(self) -> None:
        """Stop the idle timer (the deployment stops the replicas)."""
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self._timer.is_alive():
            self._timer.join(5)

    # -- what the HTTP side asks --------------------------------------------------------------

    def on_demand(self, name: str) -> bool:
        return name in self.residents

    def resident_bytes(self) -> int:
        """The planned bytes of the runtime, the pinned models and the resident on-demand
        ones: never more than the budget."""
        with self._lock:
            return self.fixed_bytes + sum(r.planned_bytes for r in self.residents.values()
                                          if r.holds_memory)

    async def acquire(self, name: str) -> float:
        """Wait until the on-demand model ``name`` is loaded, starting its load if none is
        under way, and hold it loaded until :meth:`release` (a request holds it until the
        router counts it on a replica); the seconds waited (0 when it was loaded). Raises
        :class:`NoRoomError` or :class:`LoadFailedError`; a model that failed to load stays
        failed until :meth:`load` is asked again. A pinned model: 0 at once."""
        resident = self.residents.get(name)
        if resident is None:
            return 0.0
        start = time.perf_counter()
        waited = False
        while True:
            with self._lock:
                resident.last_used = self._clock()
                if resident.status is Status.LOADED:
                    resident.in_use += 1
                    return time.perf_counter() - start if waited else 0.0
                if resident.status is Status.FAILED:
                    raise LoadFailedError(resident.error or "it failed to load")
                if resident.waiting >= resident.max_queue:
                    raise LoadQueueFullError(
                        f"{resident.waiting} requests wait for {name!r} to load (its "
                        f"max_queue is {resident.max_queue})")
                future = self._start_load(resident)
                resident.waiting += 1
            waited = True
            try:
                await asyncio.wrap_future(future)
            finally:
                with self._lock:
                    resident.waiting -= 1

    def release(self, name: str) -> None:
        """A request that :meth:`acquire` let through is on its replica now, or ended."""
        resident = self.residents.get(name)
        if resident is not None:
            with self._lock:
                resident.in_use -= 1
                resident.last_used = self._clock()

    def load(self, name: str) -> concurrent.futures.Future[None]:
        """Load the model (``POST /models/load``), a failed one again too; its future."""
        resident = self.residents[name]
        with self._lock:
            resident.last_used = self._clock()
            if resident.status is Status.LOADED:
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                return done
            if resident.status is Status.FAILED:
                resident.status, resident.error = Status.UNLOADED, None
            return self._start_load(resident)

    def unload(self, name: str, reason: str = "asked") -> bool:
        """Unload the model once its requests have finished (blocking: call it on a thread);
        whether it was loaded."""
        resident = self.residents[name]
        with self._lock:
            if resident.status is not Status.LOADED:
                return False
            resident.status = Status.UNLOADING
        self._unload(resident, reason)
        return True

    def status(self, name: str) -> dict[str, Any] | None:
        """The on-demand model's state for /v1/models and /live; None for a pinned one."""
        resident = self.residents.get(name)
        if resident is None:
            return None
        with self._lock:
            return resident.to_json()

    # -- the work, on threads -----------------------------------------------------------------

    def _start_load(self, resident: Resident) -> concurrent.futures.Future[None]:
        """The load under way, or a new one (holding the lock)."""
        if resident.load is None:
            resident.load = concurrent.futures.Future()
            threading.Thread(target=self._load, args=(resident,), daemon=True,
                             name=f"laya-load-{resident.name}").start()
        return resident.load

    def _room_for(self, resident: Resident) -> bool:
        if self.budget_bytes is None:
            return True
        held = [r for r in self.residents.values() if r is not resident and r.holds_memory]
        for device, need in resident.gpu_bytes.items():
            others = sum(r.gpu_bytes.get(device, 0) for r in held)
            if others + need > self.gpu_room.get(device, 0):
                return False
        others = sum(r.planned_bytes for r in held)
        return self.fixed_bytes + others + resident.planned_bytes <= self.budget_bytes

    def _victim(self, resident: Resident) -> Resident | None:
        """The least recently used idle loaded on-demand model other than ``resident``."""
        idle = [r for r in self.residents.values()
                if r is not resident and r.status is Status.LOADED and not r.in_use
                and not self.host.busy(r.name)]
        return min(idle, key=lambda r: r.last_used, default=None)

    def _load(self, resident: Resident) -> None:
        assert resident.load is not None
        future = resident.load
        error: BaseException | None = None
        try:
            self._make_room(resident)
            started = self._clock()
            why = self.host.load_model(resident.name)
            took = self._clock() - started
            with self._lock:
                if why is None:
                    resident.status, resident.error = Status.LOADED, None
                    resident.loads += 1
                    resident.load_seconds.append(took)
                    resident.last_used = self._clock()
                else:
                    resident.status, resident.error = Status.FAILED, why
            if why is None:
                self.host.set_routable(resident.name, True)
                log.info("%s loaded on demand in %.1f s", resident.name, took)
            else:
                log.error("%s failed to load: %s", resident.name, why)
                error = LoadFailedError(why)
        except NoRoomError as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - the waiting requests hear of it
            log.exception("loading %s failed", resident.name)
            with self._lock:
                resident.status, resident.error = Status.FAILED, f"{type(e).__name__}: {e}"
            error = LoadFailedError(resident.error)
        finally:  # the load is over before its waiters hear how it went
            with self._changed:
                resident.load = None
                self._changed.notify_all()
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _make_room(self, resident: Resident) -> None:
        """Unload the least recently used idle models until ``resident`` fits, and mark it
        loading; raises NoRoomError when its queue_timeout_s passes first."""
        deadline = self._clock() + resident.queue_timeout_s
        while True:
            with self._lock:
                if self._stopping.is_set():
                    raise NoRoomError("the server is shutting down")
                if resident.status is Status.UNLOADED and self._room_for(resident):
                    resident.status = Status.LOADING
                    return
                victim = None if resident.status is Status.UNLOADING \
                    else self._victim(resident)
                if victim is not None:
                    victim.status = Status.UNLOADING
                elif self._clock() >= deadline:
                    raise NoRoomError(self._no_room(resident))
                else:
                    self._changed.wait(TICK_S)
                    continue
            log.info("unloading %s for %s's room", victim.name, resident.name)
            self._unload(victim, "evicted")

    def _no_room(self, resident: Resident) -> str:
        busy = sorted(r.name for r in self.residents.values()
                      if r is not resident and r.holds_memory)
        held = self.fixed_bytes + sum(self.residents[n].planned_bytes for n in busy)
        return (f"no room to load {resident.name!r} ({resident.planned_bytes / 2**20:.1f} "
                f"MiB planned) within {resident.queue_timeout_s:g} s: "
                f"{held / 2**20:.1f} MiB of the {(self.budget_bytes or 0) / 2**20:.1f} MiB "
                "budget is held by the pinned models and the runtime"
                + (f" and by {', '.join(busy)}, each busy or just used" if busy else ""))

    def _unload(self, resident: Resident, reason: str) -> None:
        """Drain and stop a model marked UNLOADING (not holding the lock)."""
        self.host.set_routable(resident.name, False)
        while self.host.busy(resident.name):  # its requests finish first
            time.sleep(TICK_S / 2)
        self.host.stop_model(resident.name)
        with self._changed:
            resident.status = Status.UNLOADED
            resident.unloads[reason] += 1
            self._changed.notify_all()
        log.info("%s unloaded (%s)", resident.name, reason)

    def _watch(self) -> None:
        """The idle timer: unload a model idle for its idle_unload_s."""
        while not self._stopping.wait(TICK_S):
            now = self._clock()
            for resident in list(self.residents.values()):
                with self._lock:
                    if resident.status is not Status.LOADED:
                        continue
                if resident.in_use or self.host.busy(resident.name):
                    with self._lock:
                        resident.last_used = now
                    continue
                limit = resident.idle_unload_s
                with self._lock:
                    due = limit is not None and now - resident.last_used >= limit \
                        and resident.status is Status.LOADED and not resident.in_use
                    if due:
                        resident.status = Status.UNLOADING
                if due:
                    self._unload(resident, "idle")
