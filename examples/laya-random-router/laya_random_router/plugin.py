"""The plugin module the ``laya`` entry point names."""

from laya_core.hookspecs import Register, hookimpl

from laya_random_router.router import RandomRouter


@hookimpl
def register_routers(register: Register) -> None:
    register("random", RandomRouter)
