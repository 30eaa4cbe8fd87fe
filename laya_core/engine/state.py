"""What an engine's callers are told of it: the state it is in, and why it refuses a request.

``replica/client.py`` and the worker read these; a caller needs no engine to name them.
"""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineUnavailableError(RuntimeError):
    """The replica is loading, failed to load, or has stopped. ``retry_after_s``: how long
    the replica asks callers to wait (an upstream server's ``Retry-After``); None: the
    front end's default."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(RuntimeError):
    """As many requests wait for room as the queue holds. ``retry_after_s`` as for
    :class:`EngineUnavailableError`."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeoutError(EngineUnavailableError):
    """A request waited ``queue_timeout_s`` for a place to run and got none (an
    engine-level backend's admission, :mod:`laya_core.replica.engine_backend`)."""


class UnsupportedParameterError(ValueError):
    """A request field this replica's backend cannot honour (an engine-level backend that
    takes no output constraint, no log-probabilities): the HTTP side answers 400 naming
    ``param``, never ignores it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
