"""Registers the default scheduler as ``fcfs``."""

from laya_core.engine.scheduler import FcfsScheduler
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_schedulers(register: Register) -> None:
    register("fcfs", FcfsScheduler)
