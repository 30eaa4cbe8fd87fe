"""Which transport carries a replica, and the :class:`EngineClient` that does.

``[cluster] engine`` says where replicas run: ``"thread"`` (an :class:`Engine` on a thread
of this process, :class:`LocalEngineClient`), ``"process"`` (a worker process each,
:mod:`laya_core.replica.worker_client`), ``"ray"`` (a Ray actor each,
:mod:`laya_core.replica.ray_client`) or ``"auto"`` (processes when the caller asks: ``laya
serve`` does, code that embeds a deployment gets threads). A backend that cannot load its
tokenizer apart from its weights (``Backend.load_tokenizer``) always runs in this process:
the front end needs the tokenizer. An engine-level backend (``kind = "engine"``,
:mod:`laya_core.replica.engine_backend`) makes its replicas' clients itself, whatever
``[cluster] engine`` says. Ray is imported only when a manifest asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from laya_core.backend import Backend, ModelConfig
from laya_core.engine.engine import Engine
from laya_core.plugins import Registry
from laya_core.replica.client import EngineClient, LocalEngineClient
from laya_core.replica.engine_backend import EngineBackend
from laya_core.replica.remote import RemoteEngineClient
from laya_core.replica.worker_client import WorkerEngineClient
from laya_core.replica.worker_link import DEFAULT_SILENCE_S

log = logging.getLogger("laya_core.serving.deployment")  # where this line was always logged


@attrs.frozen
class Transports:
    """Where a deployment's replicas run, from ``[cluster]`` and the caller's wish.

    ``plugins``: ``module:attribute`` plugins a worker registers beside the installed ones
    (the registry's extra plugins, which a new process cannot inherit). ``planned_bytes``:
    each replica's ledger total, by replica id (a Ray actor asks for that much memory)."""

    engine: str  # [cluster] engine: "auto", "thread", "process" or "ray"
    processes: bool  # what "auto" means here
    address: str | None = None  # [cluster] address, for Ray
    silence_s: float = DEFAULT_SILENCE_S  # [cluster] worker_timeout_s
    plugins: Sequence[str] = ()
    planned_bytes: dict[int, int] = attrs.field(factory=dict)

    @property
    def apart(self) -> bool:
        """Whether replicas run outside this process (worker processes or Ray actors)."""
        return self.engine in ("process", "ray") or (self.engine == "auto" and self.processes)

    def connect(self) -> None:
        """Join (or start) the Ray cluster when replicas run there; else nothing."""
        if self.engine == "ray":
            from laya_core.replica import ray_client

            ray_client.connect(self.address)

    def runs_apart(self, config: ModelConfig, backend_cls: type[Backend]) -> bool:
        """Whether ``config``'s replicas run outside this process (logged when they cannot)."""
        if not self.apart or backend_cls.kind == "engine":  # an engine-level one: its own
            return False
        if backend_cls.load_tokenizer is Backend.load_tokenizer:
            log.info("%s: the %s backend cannot load its tokenizer apart from its weights, "
                     "so its replicas run in this process", config.name, config.backend)
            return False
        return True

    def remote(self, config: ModelConfig, replica: int, backend: Backend,
               on_change: Callable[[Any], None],
               on_loaded: Callable[[Any], None]) -> RemoteEngineClient:
        """A replica in a worker process or a Ray actor, not started."""
        if self.engine == "ray":
            from laya_core.replica import ray_client

            return ray_client.RayEngineClient(
                config, replica, backend, self.plugins, self.planned_bytes.get(replica),
                on_change=on_change, on_loaded=on_loaded)
        return WorkerEngineClient(config, replica, backend, self.plugins,
                                  on_change=on_change, on_loaded=on_loaded,
                                  silence_s=self.silence_s)


def replica_client(config: ModelConfig, replica: int, registry: Registry,
                   transports: Transports, apart: bool,
                   on_change: Callable[[Any], None], on_worker_loaded: Callable[[Any], None],
                   on_engine_loaded: Callable[[Engine], None], index: int = 0) -> EngineClient:
    """One replica of ``config`` (``apart``: outside this process, see
    :meth:`Transports.runs_apart`), not started; ``index``: which of the model's replicas
    (``replica`` numbers the deployment's). Its scheduler and cache policy are looked
    up here whichever transport carries it, so a missing one is this process's error."""
    backend = registry.backends[config.backend].obj(config)
    if isinstance(backend, EngineBackend):  # it owns its scheduling and cache
        client = backend.engine_client(replica, index)
        client.bind(on_change, on_worker_loaded)
        return client
    scheduler_cls = registry.schedulers[config.scheduler].obj
    cache_cls = registry.cache_policy_for(config.backend, config.cache_policy)
    if apart:
        return transports.remote(config, replica, backend, on_change, on_worker_loaded)
    return LocalEngineClient(Engine(config, backend, scheduler_cls, cache_cls,
                                    replica_id=replica, on_loaded=on_engine_loaded))
