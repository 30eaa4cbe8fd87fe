"""The plugin module the ``laya`` entry point names."""

from laya_backend_openai.backend import OpenAIBackend
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_backends(register: Register) -> None:
    register(OpenAIBackend.name, OpenAIBackend)
