"""The plugin manager: built-in plugins and third-party ones load the same way.

A third-party plugin that fails (its module does not import, a hook of its raises, it
names a hook Laya does not have, it registers a name another plugin took) is left out and
recorded as a :class:`PluginFailure` naming its package and the hook, so that the others
load; ``laya plugins`` and ``laya check`` report it (exit status 2), and a model that needs
what it would have registered is refused with its reason.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any

import attrs
import pluggy

from laya_core import hookspecs

# Built-in plugins of the core itself. Plugins shipped as their own distributions (the llama.cpp
# backend, the C++ router) arrive through the ``laya`` entry-point group like any third party's.
DEFAULT_PLUGINS = (
    "laya_core.builtin.cache_policies",
    "laya_core.builtin.schedulers",
    "laya_core.builtin.routers",
    "laya_core.builtin.model_paths",
)

FAMILIES = ("backend", "router", "scheduler", "cache_policy")
_HOOK_OF_FAMILY = {
    "backend": "register_backends",
    "router": "register_routers",
    "scheduler": "register_schedulers",
    "cache_policy": "register_cache_policies",
}


@attrs.frozen
class Registered:
    """One thing a plugin registered: its family, name, the object, and where it came from."""

    family: str
    name: str
    obj: Any
    source: str


class PluginError(Exception):
    """A plugin registered in code does not fit the hook specs."""


@attrs.frozen
class PluginFailure:
    """A plugin left out: where it came from, the hook it failed in (None: while it was
    imported and registered), and why."""

    source: str
    hook: str | None
    error: str

    def __str__(self) -> str:
        where = f"in hook {self.hook}" if self.hook else "while loading"
        return f"{self.source} failed {where}: {self.error}"


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, with where each plugin came from and the plugins left out."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.sources: dict[str, str] = {}  # plugin name -> its distribution, version, entry
        self.failures: list[PluginFailure] = []


TRACE_ENV = "LAYA_TRACE_HOOKS"
_trace_log = logging.getLogger("laya.hooks")


def get_plugin_manager(*, load_entry_points: bool = True) -> PluginManager:
    """Return a plugin manager with the built-in plugins and the ``laya`` entry points loaded."""
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    if os.environ.get(TRACE_ENV, "") not in ("", "0"):
        trace_hooks(pm)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        _load_entry_points(pm)
    return pm


def _load_entry_points(pm: PluginManager) -> None:
    """Register every ``laya`` entry point that imports and fits the specs; record the rest."""
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != hookspecs.PROJECT_NAME or pm.has_plugin(ep.name) \
                    or pm.is_blocked(ep.name):
                continue
            source = f"{dist.metadata['Name']} {dist.version} (entry point {ep.name})"
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
            except Exception as e:  # noqa: BLE001 - one broken package leaves the rest
                pm.failures.append(PluginFailure(source, None, f"{type(e).__name__}: {e}"))
                continue
            unknown = [h.name for h in pm.get_hookcallers(plugin) or () if not h.has_spec()]
            if unknown:
                pm.unregister(plugin)
                pm.failures.append(PluginFailure(
                    source, None, f"it implements {', '.join(unknown)}, which Laya has no "
                    f"hook spec for (its hooks: {', '.join(_hook_names())})"))
                continue
            pm.sources[ep.name] = source


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n),
                                                       f"{hookspecs.PROJECT_NAME}_spec"))


def trace_hooks(pm: pluggy.PluginManager) -> None:
    """Log every hook call with the plugins it runs and its duration (``laya.hooks``, at
    INFO), through pluggy's hook-call monitoring: ``LAYA_TRACE_HOOKS=1`` or ``laya serve
    --trace-hooks``."""
    started: list[float] = []

    sources = getattr(pm, "sources", {})

    def before(hook_name: str, impls: Sequence[pluggy.HookImpl],
               kwargs: Mapping[str, Any]) -> None:
        started.append(time.perf_counter())

    def after(outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, Any]) -> None:
        took = time.perf_counter() - started.pop()
        names = ", ".join(sources.get(i.plugin_name, i.plugin_name) for i in impls) \
            or "no plugin"
        failed = outcome.exception
        _trace_log.info("hook %s(%s): %s; %.3f ms%s", hook_name, ", ".join(kwargs), names,
                        took * 1e3, f"; raised {type(failed).__name__}: {failed}"
                        if failed is not None else "")

    pm.add_hookcall_monitoring(before, after)


def plugin_source(pm: pluggy.PluginManager, plugin: object) -> str:
    """Say where a plugin came from: ``builtin``, a distribution and version, or its module."""
    name = pm.get_name(plugin) or repr(plugin)
    if name in DEFAULT_PLUGINS:
        return f"builtin ({name})"
    sources = getattr(pm, "sources", {})
    if name in sources:
        return str(sources[name])
    return f"registered in code ({name})"


def collect(pm: pluggy.PluginManager, family: str,
            failures: list[PluginFailure] | None = None) -> dict[str, Registered]:
    """Ask every plugin of the manager to register its members of one family.

    The hook is called through pluggy, one registering plugin at a time (a subset caller
    that leaves the other registering plugins out, wrappers kept), so pluggy's argument
    matching, wrappers and tracing apply, and each member is credited to its plugin. A
    plugin whose hook raises keeps nothing it registered, and a name registered twice keeps
    its first plugin's; both go to ``failures`` (without it, they raise PluginError).
    """
    hook_name = _HOOK_OF_FAMILY[family]
    found: dict[str, Registered] = {}
    # Wrappers (tracing, policy) wrap every call; the others each register their members.
    plugins = [impl.plugin for impl in getattr(pm.hook, hook_name).get_hookimpls()
               if not (impl.wrapper or impl.hookwrapper)]
    for plugin in plugins:
        source = plugin_source(pm, plugin)

        mine: dict[str, Registered] = {}

        def register(name: str, obj: Any, _source: str = source,
                     _mine: dict[str, Registered] = mine) -> None:
            if name in found or name in _mine:
                first = found[name].source if name in found else _source
                raise PluginError(f"{family} {name!r} is registered twice: by {first} "
                                  f"and by {_source}")
            _mine[name] = Registered(family, name, obj, _source)

        others = [p for p in plugins if p is not plugin]
        try:
            pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
        except Exception as e:
            if failures is None:
                raise
            error = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
            failures.append(PluginFailure(source, hook_name, error))
            continue
        found.update(mine)
    return found


@attrs.define
class Registry:
    """Everything the loaded plugins registered, by family and name."""

    backends: dict[str, Registered]
    routers: dict[str, Registered]
    schedulers: dict[str, Registered]
    cache_policies: dict[str, Registered]
    plugin_manager: pluggy.PluginManager
    failures: list[PluginFailure] = attrs.Factory(list)  # the plugins left out, and why

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> Registry:
        failures = list(getattr(pm, "failures", ()))
        return cls(
            backends=collect(pm, "backend", failures),
            routers=collect(pm, "router", failures),
            schedulers=collect(pm, "scheduler", failures),
            cache_policies=collect(pm, "cache_policy", failures),
            plugin_manager=pm,
            failures=failures,
        )

    def family(self, family: str) -> dict[str, Registered]:
        return {
            "backend": self.backends,
            "router": self.routers,
            "scheduler": self.schedulers,
            "cache_policy": self.cache_policies,
        }[family]

    def router_name(self, impl: str | None) -> str:
        """The router a deployment uses: ``[router] impl``, else the C++ one where it is
        installed, else the Python reference."""
        return impl or ("cpp" if "cpp" in self.routers else "python")

    def cache_policy_for(self, backend: str, cache_policy: str = "auto") -> Any:
        """The KV-cache policy class a model uses: ``cache_policy`` by name, or with
        ``"auto"`` the first registered one serving the backend's ``kv_layout``."""
        layout = self.backends[backend].obj.kv_layout
        if cache_policy != "auto":
            return self.cache_policies[cache_policy].obj
        for entry in self.cache_policies.values():
            if entry.obj.layout == layout:
                return entry.obj
        raise LookupError(f"no installed cache policy serves the {layout} KV layout of the "
                          f"{backend} backend; install the plugin that ships one")

    def resolve_model_path(self, path: str) -> str | None:
        result: str | None = self.plugin_manager.hook.resolve_model_path(path=path)
        return result


def load_registry(extra_plugins: Iterable[object] = ()) -> Registry:
    """Load the plugin manager, register ``extra_plugins`` (objects with hookimpls), collect."""
    pm = get_plugin_manager()
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    return Registry.from_plugin_manager(pm)
