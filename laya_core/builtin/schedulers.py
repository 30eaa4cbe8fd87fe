"""Registers the default scheduler as ``fcfs``."""

from laya_core.hookspecs import Register, hookimpl
from laya_core.scheduler import FcfsScheduler


@hookimpl
def register_schedulers(register: Register) -> None:
    register("fcfs", FcfsScheduler)
