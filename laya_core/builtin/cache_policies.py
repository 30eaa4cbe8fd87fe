"""Registers the default KV-cache policy as ``blocks``."""

from laya_core.cache import BlockCachePolicy
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_cache_policies(register: Register) -> None:
    register("blocks", BlockCachePolicy)
