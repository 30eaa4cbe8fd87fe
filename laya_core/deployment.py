"""A running deployment: the engines of every model replica and the router in front of them."""

from __future__ import annotations

import collections
import logging

from laya_core.backend import ModelConfig
from laya_core.chat_template import ChatTemplate
from laya_core.engine import Engine, EngineState
from laya_core.manifest import Manifest
from laya_core.memory_plan import Plan
from laya_core.plugins import Registry
from laya_core.router import Router

log = logging.getLogger(__name__)


class UnknownModelError(LookupError):
    pass


class Deployment:
    """Builds one engine per replica from a resolved manifest; the HTTP app talks to this."""

    def __init__(self, manifest: Manifest, registry: Registry, plan: Plan | None = None) -> None:
        self.manifest = manifest
        self.registry = registry
        self.plan = plan
        # Refusals decided before a request reaches an engine: (model, reason) -> count.
        self.rejections: collections.Counter[tuple[str, str]] = collections.Counter()
        router_name = manifest.router.impl or ("cpp" if "cpp" in registry.routers else "python")
        self.router_name = router_name
        self.router: Router = registry.routers[router_name].obj()
        self.engines: list[Engine] = []
        self.models: dict[str, ModelConfig] = {}
        self._templates: dict[str, ChatTemplate] = {}
        for config in manifest.models:
            self.models[config.name] = config
            backend_cls = registry.backends[config.backend].obj
            scheduler_cls = registry.schedulers[config.scheduler].obj
            cache_cls = registry.cache_policies[config.cache_policy].obj
            for _ in range(config.replicas):
                replica = len(self.engines)
                self.engines.append(Engine(config, backend_cls(config), scheduler_cls,
                                           cache_cls, replica_id=replica))
                self.router.add_replica(config.name, replica)
            self.router.set_policy(config.name, config.routing)

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return all(engine.wait_ready(timeout) for engine in self.engines)

    @property
    def ready(self) -> bool:
        return all(e.state is EngineState.READY for e in self.engines)

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def model(self, name: str) -> ModelConfig:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModelError(name) from None

    def engines_of(self, name: str) -> list[Engine]:
        return [e for e in self.engines if e.config.name == name]

    def any_engine(self, name: str) -> Engine:
        """A loaded engine of the model, for tokenizing and limits (all replicas agree)."""
        self.model(name)
        for engine in self.engines_of(name):
            if engine.state is EngineState.READY:
                return engine
        raise RuntimeError(f"model {name!r} has no replica loaded yet")

    def chat_template(self, name: str) -> ChatTemplate:
        template = self._templates.get(name)
        if template is None:
            info = self.any_engine(name).info
            assert info is not None
            template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
            self._templates[name] = template
        return template
