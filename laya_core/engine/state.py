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
    """The replica is loading, failed to load, or has stopped."""


class QueueFullError(RuntimeError):
    """As many requests wait for room as the queue holds."""
