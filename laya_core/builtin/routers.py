"""Registers the pure-Python reference router as ``python``."""

from laya_core.hookspecs import Register, hookimpl
from laya_core.routing.router import PythonRouter


@hookimpl
def register_routers(register: Register) -> None:
    register("python", PythonRouter)
