"""LoRA adapters loaded and unloaded while a replica serves, on its engine thread.

The front end asks through :meth:`Engine.adapter`, which queues an :class:`AdapterJob` in the
engine's inbox (so a request submitted before the job is known to the engine before it).
A load runs between two steps (``Backend.load_adapter``). An unload waits until no request
of this replica uses the adapter, running or waiting, then has the cache policy forget the
KV computed under it (``KVCache.forget_adapter``), and runs between two steps
(``Backend.unload_adapter``); the front end stops routing requests to the adapter first.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from laya_core.engine.engine import Engine

OPS = ("load", "unload")


@attrs.define
class AdapterJob:
    op: str  # one of OPS
    name: str
    path: str | None  # the adapter (the backend's format), for a load
    done: concurrent.futures.Future[None] = attrs.field(factory=concurrent.futures.Future)


class AdapterJobs:
    """The engine thread's adapter work: loads at once, unloads once unused."""

    def __init__(self) -> None:
        self._unloads: list[AdapterJob] = []

    def add(self, engine: Engine, job: AdapterJob) -> None:
        if job.op == "load":
            _run(job, functools.partial(engine.backend.load_adapter, job.name, job.path or ""))
        else:
            self._unloads.append(job)
            self.check(engine)

    def check(self, engine: Engine) -> None:
        """Run the unloads whose adapter no request of the engine uses any more."""
        if not self._unloads:
            return
        used = {live.seq.params.lora for live in engine.live_requests()}
        for job in [j for j in self._unloads if j.name not in used]:
            self._unloads.remove(job)
            engine.forget_adapter_kv(job.name)
            _run(job, functools.partial(engine.backend.unload_adapter, job.name))

    def fail_all(self, error: Exception) -> None:
        for job in self._unloads:
            job.done.set_exception(error)
        self._unloads = []


def _run(job: AdapterJob, action: Callable[[], object]) -> None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - said to the front end, which answers the client
        job.done.set_exception(e)
    else:
        job.done.set_result(None)
