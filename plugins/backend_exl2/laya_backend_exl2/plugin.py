"""Registers ``exl2`` and ``exl3``. Importing this module imports neither library nor
torch: a replica's load does (laya_backend_exl2/runtime.py)."""

from laya_backend_exl2.backend import Exl2Backend, Exl3Backend
from laya_core.hookspecs import Register, hookimpl


@hookimpl
def register_backends(register: Register) -> None:
    register(Exl2Backend.name, Exl2Backend)
    register(Exl3Backend.name, Exl3Backend)
