"""Laya's C++ router: the decisions of ``laya_core.router.PythonRouter`` made in C++.

``CppRouter`` implements :class:`laya_core.router.Router`; the extension module
``laya_router._router_ext`` is private.
"""

from __future__ import annotations

from laya_core.router import NoRouteError
from laya_router import _router_ext

__all__ = ["CppRouter"]


class CppRouter(_router_ext.Router):
    """Least outstanding requests; ties go round robin in the order replicas were added.

    Every method but ``route`` is the C++ one as it is (``set_state`` takes a
    :class:`~laya_core.router.ReplicaState`, an ``IntEnum``, or its int value); ``route`` only
    translates the extension's no-route error into the core's
    :class:`~laya_core.router.NoRouteError`.
    """

    def route(self, model: str, session: str | None = None) -> int:
        """Choose a replica of ``model`` and count one more outstanding request on it.

        ``session`` is accepted for the protocol; neither router uses it yet.
        """
        try:
            return super().route(model)
        except _router_ext.NoRouteError as error:
            raise NoRouteError(str(error)) from None
