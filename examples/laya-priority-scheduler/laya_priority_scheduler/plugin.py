"""The plugin module the ``laya`` entry point names."""

from laya_core.hookspecs import Register, hookimpl

from laya_priority_scheduler.scheduler import PriorityScheduler


@hookimpl
def register_schedulers(register: Register) -> None:
    register("priority", PriorityScheduler)
