"""Laya's C++ router: the decisions of ``laya_core.routing.router.PythonRouter`` made in C++.

``CppRouter`` implements :class:`laya_core.routing.router.Router`; the extension module
``laya_router._router_ext`` is private.
"""

from __future__ import annotations

from laya_router import _router_ext

__all__ = ["CppRouter"]


class CppRouter(_router_ext.Router):
    """The four policies of :class:`laya_core.routing.router.PythonRouter`, with the same decisions.

    Every method is the C++ one as it is: ``route`` raises the core's
    :class:`~laya_core.routing.router.NoRouteError` itself, and ``set_state`` takes a
    :class:`~laya_core.routing.router.ReplicaState` (an ``IntEnum``) or its int value. Sessions are
    keyed by a 64-bit hash of their id, so each costs at most 48 bytes whatever its length.
    """
