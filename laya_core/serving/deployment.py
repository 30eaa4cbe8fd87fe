"""A running deployment: the engines of every model replica and the router in front of them."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from laya_core.backend import Backend, ModelConfig, ModelInfo
from laya_core.cli.logs import resident_bytes
from laya_core.config.manifest import Manifest
from laya_core.engine.engine import Engine, EngineState
from laya_core.memory.ledger import Plan
from laya_core.plugins import Registry
from laya_core.replica.client import EngineClient, LocalEngineClient
from laya_core.replica.remote import RemoteEngineClient
from laya_core.replica.worker_client import WorkerEngineClient
from laya_core.routing.router import ReplicaState
from laya_core.routing.router import Router
from laya_core.serving.chat_prompt import chat_prompt_ids
from laya_core.serving.chat_template import TemplateError, TemplateRefusal
from laya_core.serving.template_sandbox import TemplateSandbox
from laya_core.structured.tools import ToolUse, prompt_messages
from laya_core.units import fmt_bytes

# Conversations a model's chat template must render at load: the first it accepts passes.
# Some templates refuse a system turn or a leading assistant on purpose (raise_exception).
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi."},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}),
    ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Bye."}),
    ({"role": "user", "content": "Hi."},),
)

log = logging.getLogger(__name__)


class UnknownModelError(LookupError):
    pass


class ModelUnavailableError(RuntimeError):
    """No replica of the model can serve: still loading, or ``failed`` to load for good."""

    def __init__(self, message: str, failed: bool) -> None:
        super().__init__(message)
        self.failed = failed


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
        self.engines: list[Engine] = []  # the replicas on threads of this process
        self.workers: list[RemoteEngineClient] = []  # in worker processes or Ray actors
        # What the HTTP side uses, one per replica, by replica id (the router's choice).
        self.clients: list[EngineClient] = []
        self.models: dict[str, ModelConfig] = {}
        self.templates = TemplateSandbox()
        self.started_at: float | None = None  # time.monotonic() when the loads began
        engine_kind = manifest.cluster.engine
        self.processes = engine_kind in ("process", "ray") or (engine_kind == "auto"
                                                                and processes)
        if engine_kind == "ray":  # only then is Ray imported
            from laya_core.replica import ray_client

            ray_client.connect(manifest.cluster.address)
        planned = {r.replica: r.total_bytes for r in plan.replicas} if plan else {}
        for config in manifest.models:
            self.models[config.name] = config
            backend_cls = registry.backends[config.backend].obj
            scheduler_cls = registry.schedulers[config.scheduler].obj
            cache_cls = registry.cache_policy_for(config.backend, config.cache_policy)
            in_worker = self.processes and backend_cls.load_tokenizer is not Backend.load_tokenizer
            if self.processes and not in_worker:
                log.info("%s: the %s backend cannot load its tokenizer apart from its weights, "
                         "so its replicas run in this process", config.name, config.backend)
            for _ in range(config.replicas):
                replica = len(self.clients)
                client: EngineClient
                if in_worker and engine_kind == "ray":
                    client = ray_client.RayEngineClient(
                        config, replica, backend_cls(config), worker_plugins,
                        planned.get(replica), on_change=self._changed,
                        on_loaded=self._worker_loaded)
                    self.workers.append(client)
                elif in_worker:
                    client = WorkerEngineClient(
                        config, replica, backend_cls(config), worker_plugins,
                        on_change=self._changed, on_loaded=self._worker_loaded,
                        silence_s=manifest.cluster.worker_timeout_s)
                    self.workers.append(client)
                else:
                    engine = Engine(config, backend_cls(config), scheduler_cls, cache_cls,
                                    replica_id=replica, on_loaded=self._loaded)
                    self.engines.append(engine)
                    client = LocalEngineClient(engine)
                self.clients.append(client)
                self.router.add_replica(config.name, replica)
            self.router.set_policy(config.name, config.routing)

    def start(self) -> None:
        self.started_at = time.monotonic()
        for engine in self.engines:
            engine.start()
        for worker in self.workers:
            worker.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return all([engine.wait_ready(timeout) for engine in self.engines]
                   + [worker.wait_ready(timeout) for worker in self.workers])

    @property
    def ready(self) -> bool:
        return all(c.state().ready for c in self.clients)

    @property
    def loading(self) -> bool:
        """Whether some replica's first load has not ended yet."""
        return any(c.state().state is EngineState.LOADING for c in self.clients)

    def stop(self) -> None:
        for worker in self.workers:
            worker.begin_stop()
        for engine in self.engines:
            engine.stop()
        for worker in self.workers:
            worker.stop()
        self.templates.close()

    def _changed(self, worker: RemoteEngineClient) -> None:
        """A worker's state changed (on its supervisor's thread): the router routes only to
        replicas that are up."""
        up = worker.state().state is EngineState.READY
        self.router.set_state(worker.replica_id,
                              ReplicaState.UP if up else ReplicaState.DOWN)

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
        """Every replica of every model failed to load: nothing will ever be served."""
        return all(c.state().state is EngineState.FAILED for c in self.clients)

    def render_chat(self, info: ModelInfo, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> str:
        """The model's chat template applied to ``messages``, in the sandbox. Blocks for
        up to the sandbox's time limit: call it from a worker thread."""
        return self.templates.render(info.chat_template, info.bos_token, info.eos_token,
                                     messages, add_generation_prompt, tools)

    def chat_prompt(self, client: EngineClient, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, add_special: bool = True,
                    tools: ToolUse | None = None) -> list[int]:
        """Token ids of a chat: the template's markup as special tokens, the messages'
        content as text; tools and tool calls as the template renders them, else in the
        generic format (laya_core/structured/tools.py). Blocking (rendering and
        tokenizing): call it from a worker thread."""
        info = client.info().model_info
        tokenizer = client.tokenizer()
        messages, tool_list = prompt_messages(messages, tools, info.chat_template)
        return chat_prompt_ids(
            messages, lambda m: self.render_chat(info, m, add_generation_prompt, tool_list),
            tokenizer.encode, tokenizer.special_tokens, add_special)

    def _loaded(self, engine: Engine) -> None:
        """On the engine's thread, once its model has loaded: test the chat template, then
        log how long the load took, its planned memory and how the backend runs
        (Backend.describe)."""
        assert engine.info is not None
        self._probe_template(engine.info)
        self._log_loaded(engine.config.name, engine.replica_id, engine.kv_capacity_tokens,
                         engine.runtime(), resident_bytes())

    def _worker_loaded(self, worker: RemoteEngineClient) -> None:
        """On the worker's supervisor thread, each time its process has loaded."""
        self._probe_template(worker.info().model_info)
        self._log_loaded(worker.model, worker.replica_id, worker.state().kv_capacity_tokens,
                         worker.runtime(), worker.resident_bytes())

    def _log_loaded(self, name: str, replica: int, kv_tokens: int, runtime: dict[str, Any],
                    rss: int | None) -> None:
        took = time.monotonic() - (self.started_at or time.monotonic())
        restarts = runtime.get("restarts", 0)
        log.info("%s replica %d %s: %s; %s", name, replica,
                 f"ready in {took:.1f} s" if not restarts else f"back after restart {restarts}",
                 self._memory_of(replica, kv_tokens, rss),
                 "; ".join(f"{k} {_plain(v)}" for k, v in runtime.items()) or "-")

    def _memory_of(self, replica: int, kv_tokens: int, rss: int | None) -> str:
        """The replica's planned bytes (weights, KV pool) and its process's resident set."""
        ledgers = {r.replica: r for r in self.plan.replicas} if self.plan else {}
        ledger = ledgers.get(replica)
        parts = [f"KV pool {kv_tokens} tokens"]
        if ledger is not None:
            parts = [f"weights {fmt_bytes(ledger.profile.weights_bytes)}",
                     f"KV pool {fmt_bytes(ledger.kv_pool_bytes)} ({ledger.pool_tokens} tokens)",
                     f"planned {fmt_bytes(ledger.total_bytes)}"]
        if rss is not None:
            parts.append(f"process resident {fmt_bytes(rss)}")
        return ", ".join(parts)

    def _probe_template(self, info: ModelInfo) -> None:
        """Refuse a model whose chat template cannot render a plain conversation within the
        sandbox's bounds; runs once the model has loaded, before it serves."""
        refusals = []
        for probe in PROBES:
            try:
                self.render_chat(info, probe)
                return
            except TemplateRefusal as e:
                refusals.append(str(e))
            except TemplateError as e:
                raise TemplateError(f"the model's chat template failed a test render: {e}") \
                    from None
        raise TemplateError("the model's chat template refused every test conversation: "
                            + "; ".join(refusals))


def _plain(value: object) -> str:
    """A log line's rendering of a JSON-like value."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "-"
    return str(value)
