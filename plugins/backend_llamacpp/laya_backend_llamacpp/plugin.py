"""Registers the llama.cpp backend as ``llamacpp``."""

from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_backends(register: Register) -> None:
    register(LlamaCppBackend.name, LlamaCppBackend)
