"""The router contract and the pure-Python reference router.

A router picks the replica (one loaded engine of a model) for each request. It is table work
only: no I/O and no model, so a decision takes microseconds. The C++ router in
``plugins/router_nanobind`` implements the same contract with the same decisions; this module is
the reference it is tested against.
"""

from __future__ import annotations

import enum
import threading
from typing import Protocol


class ReplicaState(enum.IntEnum):
    UP = 0
    DRAINING = 1  # finishes what it has, takes nothing new
    DOWN = 2


class NoRouteError(LookupError):
    """No replica can take the request: unknown model, or none of its replicas is up."""


class Router(Protocol):
    """What the HTTP layer needs from a router. Replica ids are small non-negative integers."""

    def add_replica(self, model: str, replica: int, weight: int = 1) -> None:
        """Add ``replica`` to the pool of ``model`` (state UP, no outstanding requests)."""

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica``; unknown ids raise ``KeyError``."""

    def set_state(self, replica: int, state: ReplicaState) -> None:
        """Mark a replica up, draining or down; only UP replicas receive new requests."""

    def route(self, model: str, session: str | None = None) -> int:
        """Choose a replica of ``model`` and count one more outstanding request on it.

        Raises :class:`NoRouteError` when the model is unknown or has no replica up.
        """

    def release(self, replica: int) -> None:
        """One request routed to ``replica`` finished (keeps load counts true)."""

    def outstanding(self, replica: int) -> int:
        """Requests routed to ``replica`` and not yet released."""


class PythonRouter:
    """Least outstanding requests; ties go round robin in the order replicas were added.

    Exactly: among the model's UP replicas with the fewest outstanding requests, take the first
    one at or after the model's cursor (cycling through the pool in insertion order), then move
    the cursor just past it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, list[int]] = {}
        self._cursor: dict[str, int] = {}
        self._model_of: dict[int, str] = {}
        self._state: dict[int, ReplicaState] = {}
        self._outstanding: dict[int, int] = {}
        self._weight: dict[int, int] = {}

    def add_replica(self, model: str, replica: int, weight: int = 1) -> None:
        if replica < 0:
            raise ValueError(f"replica ids are >= 0, got {replica}")
        if weight < 1:
            raise ValueError(f"weight must be >= 1, got {weight}")
        with self._lock:
            if replica in self._model_of:
                raise ValueError(f"replica {replica} already exists")
            self._pools.setdefault(model, []).append(replica)
            self._cursor.setdefault(model, 0)
            self._model_of[replica] = model
            self._state[replica] = ReplicaState.UP
            self._outstanding[replica] = 0
            self._weight[replica] = weight

    def remove_replica(self, replica: int) -> None:
        with self._lock:
            model = self._model_of.pop(replica)
            pool = self._pools[model]
            index = pool.index(replica)
            pool.pop(index)
            if index < self._cursor[model]:
                self._cursor[model] -= 1
            if not pool:
                del self._pools[model], self._cursor[model]
            elif self._cursor[model] >= len(pool):
                self._cursor[model] = 0
            del self._state[replica], self._outstanding[replica], self._weight[replica]

    def set_state(self, replica: int, state: ReplicaState) -> None:
        with self._lock:
            if replica not in self._state:
                raise KeyError(replica)
            self._state[replica] = ReplicaState(state)

    def route(self, model: str, session: str | None = None) -> int:
        with self._lock:
            pool = self._pools.get(model)
            if pool is None:
                raise NoRouteError(f"no model named {model!r}")
            start = self._cursor[model]
            best: int | None = None
            best_index = 0
            for offset in range(len(pool)):
                index = (start + offset) % len(pool)
                replica = pool[index]
                if self._state[replica] is not ReplicaState.UP:
                    continue
                if best is None or self._outstanding[replica] < self._outstanding[best]:
                    best, best_index = replica, index
            if best is None:
                raise NoRouteError(f"model {model!r} has no replica up")
            self._cursor[model] = (best_index + 1) % len(pool)
            self._outstanding[best] += 1
            return best

    def release(self, replica: int) -> None:
        with self._lock:
            if self._outstanding[replica] == 0:
                raise ValueError(f"replica {replica} has no outstanding request to release")
            self._outstanding[replica] -= 1

    def outstanding(self, replica: int) -> int:
        with self._lock:
            return self._outstanding[replica]
