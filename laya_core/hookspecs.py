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

    ``factory()`` returns an object implementing :class:`laya_core.router.Router`.
    The name is what a manifest writes in ``[router] impl``.
    """


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduling policies: ``register(name, cls)``.

    ``cls(config, cache)`` returns a :class:`laya_core.scheduler.Scheduler` that chooses, each
    engine step, which sequences prefill or decode within the cache budget.
    """


@hookspec
def register_cache_policies(register: Register) -> None:
    """Register KV-cache policies: ``register(name, cls)``.

    ``cls(num_tokens, block_size)`` returns a :class:`laya_core.cache.CachePolicy` that accounts
    KV cache blocks for sequences against the replica's fixed capacity.
    """


@hookspec(firstresult=True)
def resolve_model_path(path: str) -> str | None:
    """Turn a manifest ``models[].path`` such as ``embedded:NAME`` into a file path.

    Return ``None`` when the path is not yours; the first non-``None`` answer wins.
    """
