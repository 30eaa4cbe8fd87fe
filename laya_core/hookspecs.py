"""The hook specifications of Laya's four plugin families.

Every registration hook hands the plugin a host-owned ``register`` callback; a plugin calls it
once per thing it provides. Hooks are always called with keyword arguments, so an
implementation may accept fewer arguments than its spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "laya"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def register_backends(register: Register) -> None:
    """Register backend classes: ``register(name, cls)``.

    ``cls`` is a subclass of :class:`laya_core.backend.Backend`. The class must be importable
    without importing its heavy library (torch, llama_cpp, ...): import that in ``load``.
    The name is what a manifest writes in ``models[].backend``.
    """


@hookspec
def register_routers(register: Register) -> None:
    """Register routing policies: ``register(name, factory)``.

    ``factory()`` returns an object implementing :class:`laya_core.routing.router.Router`.
    The name is what a manifest writes in ``[router] impl``.
    """


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduling policies: ``register(name, cls)``.

    ``cls(config, kv)`` (a :class:`laya_core.engine.scheduler.SchedulerConfig` and the replica's
    :class:`laya_core.kv.policies.KVCache`) returns a :class:`laya_core.engine.scheduler.Scheduler`.
    Its ``schedule()`` writes policy only: it admits waiting sequences (``can_admit`` /
    ``admit``) and returns ``self.plan(order)``, the running sequences in the order they are
    served this step; where their KV lives is the cache policy's. The name is what a
    manifest writes in ``models[].scheduler``.
    """


@hookspec
def register_cache_policies(register: Register) -> None:
    """Register KV-cache policies: ``register(name, cls)``.

    ``cls(num_tokens, max_num_seqs, prefix_caching=True)`` returns a
    :class:`laya_core.kv.policies.KVCache` serving the KV layout in its ``layout`` class
    attribute (a backend's ``kv_layout``): it allocates the backend's pool
    (``allocate(backend)``), admits sequences within it, finds their cached prefixes, and
    records the ops (objects with ``apply(backend)``) the engine applies before the step
    that needs them. The core registers ``paged`` (the KV manager's blocks); a backend with
    its own layout ships its policy and its ops in its plugin. A manifest's
    ``cache_policy = "auto"`` picks the policy serving the backend's layout.
    """


@hookspec(firstresult=True)
def resolve_model_path(path: str) -> str | None:
    """Turn a manifest ``models[].path`` such as ``embedded:NAME`` into a file path.

    Return ``None`` when the path is not yours; the first non-``None`` answer wins.
    """
