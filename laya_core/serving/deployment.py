"""A running deployment: the engines of every model replica and the router in front of them.

Its jobs are the replicas' lifecycle (start, wait, stop, the router's view of who is up) and
one snapshot of their state for /ready, /live and /metrics. Which transport carries a
replica is :mod:`laya_core.replica.factory`'s; chat prompts and the template test render
are :mod:`laya_core.serving.prompts`'; the line a loaded replica logs is
:mod:`laya_core.serving.load_log`'s.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from laya_core.backend import ModelConfig, ModelInfo
from laya_core.config.manifest import Manifest
from laya_core.engine.engine import Engine
from laya_core.engine.state import EngineState
from laya_core.logs import resident_bytes
from laya_core.memory.ledger import Plan
from laya_core.plugins import Registry
from laya_core.replica.client import EngineClient, LocalEngineClient, ReplicaSnapshot
from laya_core.replica.engine_backend import EngineBackendClient
from laya_core.replica.factory import Transports, replica_client
from laya_core.replica.remote import RemoteEngineClient
from laya_core.routing.router import ReplicaState, Router
from laya_core.serving.adapters import Adapters
from laya_core.serving.load_log import log_loaded
from laya_core.serving.prompts import ChatPrompts
from laya_core.serving.residency import Residency, Resident
from laya_core.structured.reasoning import reasoning_format
from laya_core.structured.tool_formats import ToolFormat, tool_format
from laya_core.structured.tools import ToolUse

log = logging.getLogger(__name__)


class UnknownModelError(LookupError):
    pass


class ModelUnavailableError(RuntimeError):
    """No replica of the model can serve: still loading, or ``failed`` to load for good."""

    def __init__(self, message: str, failed: bool) -> None:
        super().__init__(message)
        self.failed = failed


@attrs.frozen
class DeploymentSnapshot:
    """Every replica's state at one moment and the requests refused before any replica
    saw them: what /ready, /live and /metrics each show their way."""

    replicas: tuple[tuple[EngineClient, ReplicaSnapshot], ...]  # in replica id order
    # Refused by the front end (model -> reason -> count), e.g. too_long: no replica's.
    front_rejections: Mapping[str, Mapping[str, int]]

    @property
    def ready(self) -> bool:
        return all(s.ready for _, s in self.replicas)

    def rejections_of(self, model: str) -> dict[str, int]:
        """All of a model's refusals by reason: its replicas' and the front end's."""
        out: dict[str, int] = {}
        for _, s in self.replicas:
            if s.model == model:
                for reason, count in s.rejections.items():
                    out[reason] = out.get(reason, 0) + count
        for reason, count in self.front_rejections.get(model, {}).items():
            out[reason] = out.get(reason, 0) + count
        return out


class Deployment:
    """Builds one engine per replica from a resolved manifest; the HTTP app talks to this.

    ``processes``: run each replica in a worker process of its own (laya_core/replica/worker.py)
    rather than on a thread of this process; ``[cluster] engine`` in the manifest decides
    when it says "process" or "thread", and this argument when it says "auto" (``laya
    serve`` passes True; code that embeds a deployment gets threads unless it asks).
    ``worker_plugins``: ``module:attribute`` plugins a worker registers beside the
    installed ones (the registry's extra plugins, which a new process cannot inherit).
    """

    def __init__(self, manifest: Manifest, registry: Registry, plan: Plan | None = None,
                 processes: bool = False, worker_plugins: Sequence[str] = ()) -> None:
        self.manifest = manifest
        self.registry = registry
        self.plan = plan
        # Refusals decided before a request reaches an engine: (model, reason) -> count.
        self.rejections: collections.Counter[tuple[str, str]] = collections.Counter()
        router_name = registry.router_name(manifest.router.impl)
        self.router_name = router_name
        self.router: Router = registry.routers[router_name].obj()
        # What the HTTP side uses, one per replica, by replica id (the router's choice). An
        # on-demand model's are made again for each load (a client starts once).
        self.clients: list[EngineClient] = []
        self._make_client: list[Callable[[], EngineClient]] = []
        self._started: dict[int, float] = {}  # replica -> when its client was started
        self._stopped = False
        self.models: dict[str, ModelConfig] = {}
        # The LoRA adapters: which model each adapts, and each model's now (a replica made
        # for an on-demand model's next load loads these; /v1/models shows their paths).
        self.lora = Adapters(registry)
        # Tokens per KV block of each model's backend (Backend.block_size), known before
        # any replica loads: the router's prefix hashes and /live's blocks count in them.
        self.block_sizes: dict[str, int] = {}
        self.prompts = ChatPrompts()
        self.templates = self.prompts.sandbox
        self.started_at: float | None = None  # time.monotonic() when the loads began
        cluster = manifest.cluster
        transports = Transports(
            cluster.engine, processes, cluster.address, cluster.worker_timeout_s,
            worker_plugins, {r.replica: r.total_bytes for r in plan.replicas} if plan else {})
        self.processes = transports.apart
        self._transports = transports
        transports.connect()  # Ray's cluster, where replicas run there
        self.residency = Residency(
            self, [], plan.budget.bytes if plan else None,
            plan.runtime_bytes + sum(r.total_bytes for r in plan.pinned) if plan else 0,
            gpu_room=plan.gpu_room if plan else None)
        for config in manifest.models:
            self._add(config)

    def _add(self, config: ModelConfig) -> None:
        """Make the model's replicas (not started) and give them to the router. The lists
        and maps the HTTP side reads are replaced whole, never changed in place: a model
        found while serving is added on another thread."""
        registry = self.registry
        cls = registry.backends[config.backend].obj
        apart = self._transports.runs_apart(config, cls)
        clients, makers = list(self.clients), list(self._make_client)
        self.lora.add_model(config)
        for index in range(config.replicas):
            make = functools.partial(self._replica_client, config, len(clients), apart, index)
            makers.append(make)
            clients.append(make())
        self._make_client, self.clients = makers, clients
        self.block_sizes = {**self.block_sizes, config.name: cls.block_size}
        for client in clients[-config.replicas:]:
            self.router.add_replica(config.name, client.replica_id)
            if config.on_demand:  # no requests until it has loaded
                self.router.set_state(client.replica_id, ReplicaState.DOWN)
        self.router.set_policy(config.name, config.routing)
        if config.on_demand:
            self.residency.add(Resident(
                config.name, self.plan.model_bytes(config.name) if self.plan else 0,
                config.queue_timeout_s, config.idle_unload_s, config.max_queue,
                gpu_bytes=self.plan.model_gpu_bytes(config.name) if self.plan else {}))
        self.models = {**self.models, config.name: config}

    def _replica_client(self, config: ModelConfig, replica: int, apart: bool,
                        index: int) -> EngineClient:
        """A new client of one of ``config``'s replicas, loading the model's adapters now."""
        config = attrs.evolve(config, lora=self.lora.of(config.name))
        return replica_client(config, replica, self.registry, self._transports, apart,
                              self._changed, self._worker_loaded, self._loaded, index)

    def add_model(self, config: ModelConfig, plan: Plan | None) -> None:
        """Serve one more model, loaded on demand (one found while serving: ``laya serve
        --models-dir``); ``plan``: this deployment's plan with it (planner.plan_added)."""
        if not config.on_demand:
            raise ValueError(f"{config.name}: a model added while serving loads on demand")
        if config.name in self.models:
            raise ValueError(f"a model named {config.name!r} is served already")
        self.plan = plan
        self._add(config)

    @property
    def engines(self) -> list[Engine]:
        """The replicas on threads of this process."""
        return [c.engine for c in self.clients if isinstance(c, LocalEngineClient)]

    @property
    def workers(self) -> list[RemoteEngineClient | EngineBackendClient]:
        """The replicas in worker processes or Ray actors, or an engine-level backend's."""
        return [c for c in self.clients if not isinstance(c, LocalEngineClient)]  # type: ignore[misc]

    def _pinned(self) -> list[EngineClient]:
        return [c for c in self.clients if not self.models[c.model].on_demand]

    def start(self) -> None:
        """Start the pinned models' replicas; the on-demand ones load at their first
        request (laya_core/serving/residency.py)."""
        self.started_at = time.monotonic()
        for client in self._pinned():
            self._start(client)
        self.residency.start()

    def _start(self, client: EngineClient) -> None:
        if self._stopped:  # a load that raced the shutdown starts nothing
            raise RuntimeError("the server is shutting down")
        self._started[client.replica_id] = time.monotonic()
        if isinstance(client, LocalEngineClient):
            client.engine.start()
        else:
            client.start()  # type: ignore[attr-defined]

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the pinned models' first loads; whether all are ready."""
        return all([_wait_ready(c, timeout) for c in self._pinned()])

    @property
    def ready(self) -> bool:
        return all(c.state().ready for c in self._pinned())

    @property
    def loading(self) -> bool:
        """Whether some pinned replica's first load has not ended yet."""
        return any(c.state().state is EngineState.LOADING for c in self._pinned())

    def stop(self) -> None:
        self._stopped = True
        self.residency.stop()
        self._stop([c for c in self.clients if c.replica_id in self._started])
        self.prompts.close()

    def _stop(self, clients: Sequence[EngineClient]) -> None:
        """Stop replicas together: every worker is asked first, then each is waited for."""
        workers = [c for c in clients if not isinstance(c, LocalEngineClient)]
        for worker in workers:
            worker.begin_stop()  # type: ignore[attr-defined]
        for client in clients:
            if isinstance(client, LocalEngineClient):
                client.engine.stop()
        for worker in workers:
            worker.stop()  # type: ignore[attr-defined]

    # -- the residency's host (on-demand models) ---------------------------------------------

    def load_model(self, name: str) -> str | None:
        """Start fresh replicas of ``name`` and wait for them: None, or why they failed (then
        they are stopped)."""
        replicas = [c.replica_id for c in self.clients_of(name)]
        for replica in replicas:
            if replica in self._started:  # a client starts once: a new one for this load
                self.clients[replica] = self._make_client[replica]()
            self._start(self.clients[replica])
        clients = [self.clients[r] for r in replicas]
        if all([_wait_ready(c, None) for c in clients]):
            return None
        states = [c.state() for c in clients]
        self._stop(clients)
        return "; ".join(sorted({s.error or s.state.value for s in states}))

    def stop_model(self, name: str) -> None:
        self._stop([c for c in self.clients_of(name) if c.replica_id in self._started])

    def set_routable(self, name: str, routable: bool) -> None:
        for client in self.clients_of(name):
            up = routable and client.state().ready
            self.router.set_state(client.replica_id,
                                  ReplicaState.UP if up else ReplicaState.DOWN)

    def busy(self, name: str) -> bool:
        for client in self.clients_of(name):
            if self.router.outstanding(client.replica_id) > 0:
                return True
            if client.replica_id in self._started:
                state = client.state()
                if state.num_running or state.num_waiting:
                    return True
        return False

    def _changed(self, worker: EngineClient) -> None:
        """A worker's state changed (on its supervisor's thread): the router routes only to
        replicas that are up."""
        if self.clients[worker.replica_id] is not worker:
            return  # an on-demand model's client of an earlier load
        up = worker.state().state is EngineState.READY
        self.router.set_state(worker.replica_id,
                              ReplicaState.UP if up else ReplicaState.DOWN)

    def replica_state(self, client: EngineClient, state: ReplicaSnapshot) -> str:
        """What /ready and /live say of a replica's state: its engine's, or for a model
        loaded on demand and not loaded now, the model's (``unloaded``, ``failed``)."""
        resident = self.residency.status(client.model)
        if resident is not None and client.replica_id not in self._started:
            return str(resident["status"])
        if resident is not None and resident["status"] in ("unloaded", "failed"):
            return str(resident["status"])
        return state.state.value

    def snapshot(self) -> DeploymentSnapshot:
        """Every replica's state now, and the front end's refusals (one read of each)."""
        front: dict[str, dict[str, int]] = {}
        for (model, reason), count in self.rejections.items():
            front.setdefault(model, {})[reason] = count
        return DeploymentSnapshot(tuple((c, c.state()) for c in self.clients), front)

    def model(self, name: str) -> ModelConfig:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModelError(name) from None

    def engines_of(self, name: str) -> list[Engine]:
        return [e for e in self.engines if e.config.name == name]

    def clients_of(self, name: str) -> list[EngineClient]:
        return [c for c in self.clients if c.model == name]

    def any_client(self, name: str) -> EngineClient:
        """A loaded replica of the model, for tokenizing and limits (all replicas agree);
        raises :class:`ModelUnavailableError` saying whether one may still come."""
        self.model(name)
        if (resident := self.residency.status(name)) is not None \
                and resident["status"] != "loaded":
            if resident["status"] == "failed":
                raise ModelUnavailableError(f"the model {name!r} failed to load: "
                                            f"{resident['error']}", True)
            raise ModelUnavailableError(f"the model {name!r} is {resident['status']}", False)
        clients = self.clients_of(name)
        states = [c.state() for c in clients]
        for client, state in zip(clients, states, strict=True):
            if state.ready:
                return client
        if all(s.state in (EngineState.FAILED, EngineState.STOPPED) for s in states):
            reasons = "; ".join(sorted({s.error or s.state.value for s in states}))
            raise ModelUnavailableError(f"the model {name!r} failed to load: {reasons}", True)
        restarting = sorted({s.error for s in states if s.error})
        if restarting:  # a worker died and is starting again
            raise ModelUnavailableError(f"the model {name!r} is restarting: "
                                        + "; ".join(restarting), False)
        raise ModelUnavailableError(f"the model {name!r} is still loading", False)

    @property
    def all_failed(self) -> bool:
        """Every replica of every pinned model failed to load, and no model loads on
        demand: nothing will ever be served."""
        return not self.residency.residents and all(
            c.state().state is EngineState.FAILED for c in self.clients)

    def render_chat(self, info: ModelInfo, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> str:
        """The model's chat template applied to ``messages`` (see :class:`ChatPrompts`)."""
        return self.prompts.render(info, messages, add_generation_prompt, tools)

    def tool_format(self, client: EngineClient) -> ToolFormat:
        """The tool-call format of a replica's model: the one its chat template shows, or
        the model's ``tool_call_format`` where its manifest entry names one."""
        override = self.models[client.model].tool_call_format
        return tool_format(client.info().model_info.chat_template, override,
                           client.tokenizer())

    def reasoning_format(self, client: EngineClient) -> str:
        """How a replica's model writes its reasoning ("think" or "none"): its manifest
        entry's ``reasoning_format``, or with "auto" what its chat template shows."""
        override = self.models[client.model].reasoning_format
        return reasoning_format(client.info().model_info.chat_template, override)

    def chat_prompt(self, client: EngineClient, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, add_special: bool = True,
                    tools: ToolUse | None = None,
                    variables: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a chat (see :meth:`ChatPrompts.prompt_ids`); call it from a worker
        thread."""
        return self.prompts.prompt_ids(client, messages, add_generation_prompt, add_special,
                                       tools, variables)

    def _loaded(self, engine: Engine) -> None:
        """On the engine's thread, once its model has loaded: test the chat template, then
        log how long the load took, its planned memory and how the backend runs
        (Backend.describe)."""
        assert engine.info is not None
        self.prompts.probe(engine.info)
        self._log_loaded(engine.config.name, engine.replica_id, engine.kv_capacity_tokens,
                         engine.runtime(), resident_bytes())

    def _worker_loaded(self, worker: RemoteEngineClient | EngineBackendClient) -> None:
        """On the worker's supervisor thread, each time its process has loaded."""
        self.prompts.probe(worker.info().model_info)
        self._log_loaded(worker.model, worker.replica_id, worker.state().kv_capacity_tokens,
                         worker.runtime(), worker.resident_bytes())

    def _log_loaded(self, name: str, replica: int, kv_tokens: int, runtime: dict[str, Any],
                    rss: int | None) -> None:
        ledgers = {r.replica: r for r in self.plan.replicas} if self.plan else {}
        started = self._started.get(replica, self.started_at or time.monotonic())
        log_loaded(name, replica, time.monotonic() - started, kv_tokens, runtime, rss,
                   ledgers.get(replica))


def _wait_ready(client: EngineClient, timeout: float | None) -> bool:
    if isinstance(client, LocalEngineClient):
        return client.engine.wait_ready(timeout)
    return bool(client.wait_ready(timeout))  # type: ignore[attr-defined]
