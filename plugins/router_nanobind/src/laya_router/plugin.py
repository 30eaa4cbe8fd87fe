"""Registers the C++ router as ``cpp`` (entry point ``router_cpp`` in the ``laya`` group)."""

from laya_core.hookspecs import Register, hookimpl
from laya_router import CppRouter


@hookimpl
def register_routers(register: Register) -> None:
    register("cpp", CppRouter)
