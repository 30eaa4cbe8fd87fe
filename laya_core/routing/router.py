"""The router contract and the pure-Python reference router.

A router picks the replica (one loaded engine of a model) for each request. It is table work
only: no I/O and no model, so a decision takes microseconds. The C++ router in
``plugins/router_nanobind`` implements the same contract with the same decisions; this module is
the reference it is tested against.

The tables, per model (a *pool*, shared by the model's aliases):

- the replicas, in the order they were added: weight, state, outstanding requests;
- sessions: session id -> the replica that served it, least recently used first out;
- the prefix index: block hash (``laya_core/kv/hashing.py``: the chain the KV cache indexes
  its blocks by) -> the replica that last served a prompt starting with those blocks, least
  recently used first out.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

import attrs

POLICIES = ("least_outstanding", "round_robin", "session", "prefix")

# Memory cap, per model and table: C++ keeps a fixed-size entry per session (a 64-bit hash of
# the id, not the id) or prefix block, about 48 bytes with its share of the index (measured: 46
# and 50 bytes of RSS), so a full table of 65,536 costs about 3 MiB. The Python reference takes
# about 130 bytes an entry, plus the session id strings it keeps alive.
DEFAULT_SESSION_CAPACITY = 65_536
DEFAULT_PREFIX_CAPACITY = 65_536
# Outstanding requests a prefix holder may carry beyond the least loaded replica and still be
# chosen: reusing a cached prefix saves its prefill, waiting behind 3 requests costs more.
DEFAULT_IMBALANCE_THRESHOLD = 2

K = TypeVar("K")
V = TypeVar("V")


class ReplicaState(enum.IntEnum):
    """Whether the router sends a replica new requests; part of the router plugins' contract
    (the C++ router takes the same values). A replica's counters are another type,
    :class:`~laya_core.replica.client.ReplicaSnapshot`."""

    UP = 0
    DRAINING = 1  # finishes what it has, takes nothing new
    DOWN = 2


class NoRouteError(LookupError):
    """No replica can take the request: unknown model, or none of its replicas is up."""


class Router(Protocol):
    """What the HTTP layer needs from a router. Replica ids are small non-negative integers.

    A router class may say which policies it offers in a ``policies`` class attribute (a
    manifest's ``routing`` is checked against it); without one, :data:`POLICIES`."""

    def add_replica(self, model: str, replica: int, weight: int = 1) -> None:
        """Add ``replica`` to the pool of ``model`` (state UP, no outstanding requests)."""

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica``; unknown ids raise ``KeyError``."""

    def set_state(self, replica: int, state: ReplicaState) -> None:
        """Mark a replica up, draining or down; only UP replicas receive new requests."""

    def add_alias(self, alias: str, model: str) -> None:
        """Route requests for ``alias`` to the pool of ``model`` (which need not have replicas yet).

        A name is a model or an alias for good: ``ValueError`` if ``alias`` is already either,
        if ``model`` is an alias, or if they are the same name.
        """

    def set_policy(self, model: str, policy: str, imbalance_threshold: int | None = None) -> None:
        """Choose how ``model`` (or the model an alias names) routes: one of :data:`POLICIES`.

        ``imbalance_threshold`` (outstanding requests, >= 0) is used by ``"prefix"``; ``None``
        means the router's default. The setting outlives the model's replicas.
        """

    def route(self, model: str, session: str | None = None, prefix: Sequence[int] = ()) -> int:
        """Choose a replica of ``model`` and count one more outstanding request on it.

        ``session`` is the client's conversation id; ``prefix`` is ``prefix_hashes`` of the
        rendered prompt (unsigned 64-bit ints). Each policy reads only the input it needs, so a
        caller always passes both. Raises :class:`NoRouteError` when the model is unknown or has
        no replica up.
        """

    def release(self, replica: int) -> None:
        """One request routed to ``replica`` finished (keeps load counts true)."""

    def outstanding(self, replica: int) -> int:
        """Requests routed to ``replica`` and not yet released."""


@attrs.define(eq=False)
class _Replica:
    id: int
    pool: _Pool
    weight: int
    state: ReplicaState = ReplicaState.UP
    num_outstanding: int = 0
    current_weight: int = 0  # smooth weighted round robin's running score


@attrs.define(eq=False)
class _Pool:
    policy: str
    imbalance_threshold: int
    replicas: list[_Replica] = attrs.Factory(list)  # insertion order: the round-robin order
    cursor: int = 0  # where the next least-outstanding scan starts
    # session id -> (replica id, last use in time.monotonic() seconds; 0.0 without a TTL)
    sessions: OrderedDict[str, tuple[int, float]] = attrs.Factory(OrderedDict)
    prefixes: OrderedDict[int, int] = attrs.Factory(OrderedDict)  # block hash -> replica id


class PythonRouter:
    """The reference router; every decision is deterministic.

    A request for ``model`` (an alias first resolves to its model) is routed in its pool, among
    the replicas that are UP; none up, or no pool, raises :class:`NoRouteError`. The policy set
    with ``set_policy`` (default ``"least_outstanding"``) decides:

    - ``least_outstanding``: among the UP replicas with the fewest outstanding requests, the
      first at or after the pool's cursor (cycling through the pool in insertion order); the
      cursor then moves just past it, so ties go round robin. Weights are not used.
    - ``round_robin``: smooth weighted round robin as nginx does it. Each UP replica, in
      insertion order, adds its weight to its score; the first with the highest score is
      chosen and loses the sum of the UP replicas' weights. Scores start at 0 when a replica is
      added and are kept while it is not UP. Weights 5, 1, 1 give a a b a c a a.
    - ``session``: the replica remembered for ``session`` if it is still an UP replica of this
      pool and the entry is not older than ``session_ttl_s``; otherwise least_outstanding
      chooses and the session moves there. Either way the session becomes the most recently
      used entry (its age restarts). ``session=None`` is least_outstanding.
    - ``prefix``: the *holder* is the replica remembered for the last hash of ``prefix`` that
      maps to an UP replica of this pool (the longest matching prefix). The holder is chosen
      unless its outstanding count exceeds that of least_outstanding's choice by more than the
      imbalance threshold; then least_outstanding's choice is taken. Every hash of ``prefix``
      is then remembered, in order, for the chosen replica.

    The least_outstanding cursor moves only when least_outstanding's choice is taken. Tables
    are LRU-bounded: inserting into a full one drops the least recently used entry; a session
    insert first drops the expired entries at the old end. Entries naming a replica that is
    removed, down, draining or moved to another model are ignored and overwritten, never
    purged eagerly. A pool, its policy and its aliases outlive its last replica; a name is a
    model or an alias for good. The C++ router keys sessions by a 64-bit hash of the id, so two
    ids that collide share a replica there (odds about n^2 / 2^65 for n live sessions).

    One lock guards everything: this router is the readable reference, the C++ one the fast.
    """

    def __init__(
        self,
        *,
        session_capacity: int = DEFAULT_SESSION_CAPACITY,
        session_ttl_s: float | None = None,
        prefix_capacity: int = DEFAULT_PREFIX_CAPACITY,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    ) -> None:
        if not (1 <= session_capacity < 2**31 and 1 <= prefix_capacity < 2**31):
            raise ValueError("session_capacity and prefix_capacity must be in [1, 2**31)")
        if session_ttl_s is not None and not session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0 or None, got {session_ttl_s}")
        _check_threshold(imbalance_threshold)
        self._session_capacity = session_capacity
        self._session_ttl_s = session_ttl_s
        self._prefix_capacity = prefix_capacity
        self._imbalance_threshold = imbalance_threshold
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}  # model name -> pool; kept when replicas go
        self._aliases: dict[str, str] = {}  # alias -> model name
        self._replicas: dict[int, _Replica] = {}

    # --- tables -------------------------------------------------------------------------------

    def add_replica(self, model: str, replica: int, weight: int = 1) -> None:
        if replica < 0:
            raise ValueError(f"replica ids are >= 0, got {replica}")
        if weight < 1:
            raise ValueError(f"weight must be >= 1, got {weight}")
        with self._lock:
            if replica in self._replicas:
                raise ValueError(f"replica {replica} already exists")
            if model in self._aliases:
                raise ValueError(f"{model!r} is an alias of {self._aliases[model]!r}, not a model")
            pool = self._pool_for_model(model)
            self._replicas[replica] = entry = _Replica(replica, pool, weight)
            pool.replicas.append(entry)

    def remove_replica(self, replica: int) -> None:
        with self._lock:
            entry = self._replicas.pop(replica)
            pool = entry.pool
            index = pool.replicas.index(entry)
            pool.replicas.pop(index)
            # Keep the cursor on the same next replica: everything after `index` moved left.
            if index < pool.cursor:
                pool.cursor -= 1
            if pool.cursor >= len(pool.replicas):
                pool.cursor = 0

    def set_state(self, replica: int, state: ReplicaState) -> None:
        with self._lock:
            if replica not in self._replicas:
                raise KeyError(replica)
            self._replicas[replica].state = ReplicaState(state)

    def add_alias(self, alias: str, model: str) -> None:
        with self._lock:
            if alias == model:
                raise ValueError(f"cannot alias {alias!r} to itself")
            if alias in self._aliases:
                raise ValueError(f"{alias!r} is already an alias of {self._aliases[alias]!r}")
            if alias in self._pools:
                raise ValueError(f"{alias!r} is a model name, it cannot become an alias")
            if model in self._aliases:
                raise ValueError(f"{model!r} is an alias; alias {self._aliases[model]!r} instead")
            self._pool_for_model(model)
            self._aliases[alias] = model

    def set_policy(self, model: str, policy: str, imbalance_threshold: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {POLICIES}")
        if imbalance_threshold is not None:
            _check_threshold(imbalance_threshold)
        with self._lock:
            pool = self._pool_for_model(self._aliases.get(model, model))
            pool.policy = policy
            pool.imbalance_threshold = (
                self._imbalance_threshold if imbalance_threshold is None else imbalance_threshold
            )

    def _pool_for_model(self, model: str) -> _Pool:
        pool = self._pools.get(model)
        if pool is None:
            self._pools[model] = pool = _Pool("least_outstanding", self._imbalance_threshold)
        return pool

    # --- requests -----------------------------------------------------------------------------

    def route(self, model: str, session: str | None = None, prefix: Sequence[int] = ()) -> int:
        with self._lock:
            pool = self._pools.get(self._aliases.get(model, model))
            if pool is None:
                raise NoRouteError(f"no model named {model!r}")
            least = _least_outstanding(pool)
            if least is None:
                raise NoRouteError(f"model {model!r} has no replica up")
            if pool.policy == "round_robin":
                chosen = _smooth_weighted(pool)
            elif pool.policy == "session" and session is not None:
                chosen = self._by_session(pool, least, session)
            elif pool.policy == "prefix":
                chosen = self._by_prefix(pool, least, prefix)
            else:
                chosen = _take(pool, least)
            chosen.num_outstanding += 1
            return chosen.id

    def release(self, replica: int) -> None:
        with self._lock:
            entry = self._replicas[replica]
            if entry.num_outstanding == 0:
                raise ValueError(f"replica {replica} has no outstanding request to release")
            entry.num_outstanding -= 1

    def outstanding(self, replica: int) -> int:
        with self._lock:
            return self._replicas[replica].num_outstanding

    def _up_member(self, pool: _Pool, replica: int) -> _Replica | None:
        entry = self._replicas.get(replica)
        if entry is None or entry.pool is not pool or entry.state is not ReplicaState.UP:
            return None
        return entry

    def _by_session(self, pool: _Pool, least: int, session: str) -> _Replica:
        ttl = self._session_ttl_s
        now = 0.0 if ttl is None else time.monotonic()
        known = pool.sessions.get(session)
        chosen = None
        if known is not None and (ttl is None or now - known[1] <= ttl):
            chosen = self._up_member(pool, known[0])
        if chosen is None:
            chosen = _take(pool, least)
        sessions = pool.sessions
        # The oldest entry is first: touching an entry moves it last with the current time.
        while ttl is not None and sessions and now - next(iter(sessions.values()))[1] > ttl:
            sessions.popitem(last=False)
        _remember(sessions, session, (chosen.id, now), self._session_capacity)
        return chosen

    def _by_prefix(self, pool: _Pool, least: int, prefix: Sequence[int]) -> _Replica:
        holder = None
        for block_hash in reversed(prefix):
            known = pool.prefixes.get(block_hash)
            if known is not None and (holder := self._up_member(pool, known)) is not None:
                break
        least_loaded = pool.replicas[least].num_outstanding
        if holder is not None and holder.num_outstanding - least_loaded <= pool.imbalance_threshold:
            chosen = holder
        else:
            chosen = _take(pool, least)
        for block_hash in prefix:
            _remember(pool.prefixes, block_hash, chosen.id, self._prefix_capacity)
        return chosen


def _check_threshold(imbalance_threshold: int) -> None:
    if imbalance_threshold < 0:
        raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")


def _least_outstanding(pool: _Pool) -> int | None:
    """Index of the first UP replica with the fewest outstanding requests, from the cursor."""
    replicas, best = pool.replicas, None
    for offset in range(len(replicas)):
        index = (pool.cursor + offset) % len(replicas)
        candidate = replicas[index]
        if candidate.state is not ReplicaState.UP:
            continue
        if best is None or candidate.num_outstanding < replicas[best].num_outstanding:
            best = index
    return best


def _take(pool: _Pool, index: int) -> _Replica:
    """Take least_outstanding's choice: the cursor moves just past it."""
    pool.cursor = (index + 1) % len(pool.replicas)
    return pool.replicas[index]


def _smooth_weighted(pool: _Pool) -> _Replica:
    best: _Replica | None = None
    total = 0
    for candidate in pool.replicas:
        if candidate.state is not ReplicaState.UP:
            continue
        candidate.current_weight += candidate.weight
        total += candidate.weight
        if best is None or candidate.current_weight > best.current_weight:
            best = candidate
    assert best is not None  # route() checked that a replica is up
    best.current_weight -= total
    return best


def _remember(table: OrderedDict[K, V], key: K, value: V, capacity: int) -> None:
    """Store ``key`` as the most recently used entry; drop the least recent beyond capacity."""
    table[key] = value
    table.move_to_end(key)
    if len(table) > capacity:
        table.popitem(last=False)
