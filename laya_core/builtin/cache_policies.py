"""Registers the core's KV-cache policy for paged backends as ``paged``."""

from laya_core.hookspecs import Register, hookimpl
from laya_core.kv.policies import PagedKVCache


@hookimpl
def register_cache_policies(register: Register) -> None:
    register("paged", PagedKVCache)
