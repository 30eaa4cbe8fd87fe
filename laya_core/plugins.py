"""The plugin manager: built-in plugins and third-party ones load the same way."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
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
    """A plugin could not be loaded or registered something twice."""


def get_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """Return a plugin manager with the built-in plugins and the ``laya`` entry points loaded."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT_NAME)
    return pm


def plugin_source(pm: pluggy.PluginManager, plugin: object) -> str:
    """Say where a plugin came from: ``builtin``, a distribution and version, or its module."""
    name = pm.get_name(plugin) or repr(plugin)
    if name in DEFAULT_PLUGINS:
        return f"builtin ({name})"
    for dist_plugin, dist in pm.list_plugin_distinfo():
        if dist_plugin is plugin:
            return f"{dist.project_name} {dist.version} (entry point {name})"
    return f"registered in code ({name})"


def collect(pm: pluggy.PluginManager, family: str) -> dict[str, Registered]:
    """Ask every plugin of the manager to register its members of one family.

    The hook is called through pluggy, one registering plugin at a time (a subset caller
    that leaves the other registering plugins out, wrappers kept), so pluggy's argument
    matching, wrappers and tracing apply, and each member is credited to its plugin.
    """
    hook_name = _HOOK_OF_FAMILY[family]
    found: dict[str, Registered] = {}
    # Wrappers (tracing, policy) wrap every call; the others each register their members.
    plugins = [impl.plugin for impl in getattr(pm.hook, hook_name).get_hookimpls()
               if not (impl.wrapper or impl.hookwrapper)]
    for plugin in plugins:
        source = plugin_source(pm, plugin)

        def register(name: str, obj: Any, _source: str = source) -> None:
            if name in found:
                raise PluginError(
                    f"{family} {name!r} is registered twice: by {found[name].source} "
                    f"and by {_source}"
                )
            found[name] = Registered(family, name, obj, _source)

        others = [p for p in plugins if p is not plugin]
        pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
    return found


@attrs.define
class Registry:
    """Everything the loaded plugins registered, by family and name."""

    backends: dict[str, Registered]
    routers: dict[str, Registered]
    schedulers: dict[str, Registered]
    cache_policies: dict[str, Registered]
    plugin_manager: pluggy.PluginManager

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> Registry:
        return cls(
            backends=collect(pm, "backend"),
            routers=collect(pm, "router"),
            schedulers=collect(pm, "scheduler"),
            cache_policies=collect(pm, "cache_policy"),
            plugin_manager=pm,
        )

    def family(self, family: str) -> dict[str, Registered]:
        return {
            "backend": self.backends,
            "router": self.routers,
            "scheduler": self.schedulers,
            "cache_policy": self.cache_policies,
        }[family]

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
