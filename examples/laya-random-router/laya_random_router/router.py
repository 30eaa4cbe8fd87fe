"""The ``random`` router: a replica drawn in proportion to its weight, among those up."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import attrs

from laya_core.routing.router import NoRouteError, ReplicaState


@attrs.define
class _Replica:
    model: str
    weight: int
    state: ReplicaState = ReplicaState.UP
    outstanding: int = 0


class RandomRouter:
    """Every method of laya_core.routing.router.Router; ``route`` draws among the UP replicas of
    the model (or of the model an alias names), weighted. ``seed`` makes the draws
    repeatable (tests)."""

    policies = ("random",)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._replicas: dict[int, _Replica] = {}
        self._aliases: dict[str, str] = {}
        self._models: set[str] = set()
        self._lock = threading.Lock()

    def add_replica(self, model: str, replica: int, weight: int = 1) -> None:
        if weight < 1:
            raise ValueError(f"a replica's weight must be at least 1, got {weight}")
        with self._lock:
            self._models.add(model)
            self._replicas[replica] = _Replica(model, weight)

    def remove_replica(self, replica: int) -> None:
        with self._lock:
            del self._replicas[replica]  # KeyError for an unknown id, as the contract says

    def set_state(self, replica: int, state: ReplicaState) -> None:
        with self._lock:
            self._replicas[replica].state = state

    def add_alias(self, alias: str, model: str) -> None:
        with self._lock:
            if alias == model or alias in self._aliases or alias in self._models \
                    or model in self._aliases:
                raise ValueError(f"{alias!r} cannot name {model!r}: a name is a model or an "
                                 "alias for good, and an alias names a model")
            self._aliases[alias] = model
            self._models.add(model)

    def set_policy(self, model: str, policy: str, imbalance_threshold: int | None = None) -> None:
        if policy not in self.policies:
            raise ValueError(f"the random router has no policy {policy!r}; it offers "
                             f"{', '.join(self.policies)}")

    def route(self, model: str, session: str | None = None, prefix: Sequence[int] = ()) -> int:
        with self._lock:
            model = self._aliases.get(model, model)
            up = [(i, r) for i, r in self._replicas.items()
                  if r.model == model and r.state is ReplicaState.UP]
            if not up:
                raise NoRouteError(f"no replica of {model!r} is up")
            (chosen, replica), = self._rng.choices(up, weights=[r.weight for _, r in up])
            replica.outstanding += 1
            return chosen

    def release(self, replica: int) -> None:
        with self._lock:
            entry = self._replicas.get(replica)
            if entry is not None and entry.outstanding:
                entry.outstanding -= 1

    def outstanding(self, replica: int) -> int:
        with self._lock:
            return self._replicas[replica].outstanding
