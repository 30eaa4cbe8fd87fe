"""Registers the llama.cpp backend as ``llamacpp`` and its KV-stream cache policy as
``llamacpp-streams``."""

from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_backend_llamacpp.streams import StreamsKVCache
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_backends(register: Register) -> None:
    register(LlamaCppBackend.name, LlamaCppBackend)


@hookimpl
def register_cache_policies(register: Register) -> None:
    register("llamacpp-streams", StreamsKVCache)
