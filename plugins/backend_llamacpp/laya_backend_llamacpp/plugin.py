"""Registers the llama.cpp backend as ``llamacpp``."""

from laya_core.hookspecs import Register, hookimpl

from laya_backend_llamacpp.backend import LlamaCppBackend


@hookimpl
def register_backends(register: Register) -> None:
    register(LlamaCppBackend.name, LlamaCppBackend)
