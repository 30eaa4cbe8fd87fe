"""CppRouter makes exactly the decisions of PythonRouter: set scenarios, then random ones."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from laya_router import CppRouter

from laya_core.routing.router import POLICIES, PythonRouter, ReplicaState, Router

# --- scenarios, one per policy rule -----------------------------------------------------------

Scenario = Callable[[Router], list[int]]


def pool(router: Router, policy: str, *weights: int, model: str = "m") -> None:
    for replica, weight in enumerate(weights):
        router.add_replica(model, replica, weight)
    router.set_policy(model, policy)


def ties_round_robin(router: Router) -> list[int]:
    pool(router, "least_outstanding", 1, 1, 1)
    routed = [router.route("m") for _ in range(4)]
    router.release(1)
    router.remove_replica(0)
    return [*routed, router.route("m"), router.route("m")]


def smooth_weighted(router: Router) -> list[int]:
    pool(router, "round_robin", 5, 1, 1, 2)
    routed = [router.route("m") for _ in range(9)]
    router.set_state(3, ReplicaState.DOWN)
    return routed + [router.route("m") for _ in range(9)]


def sticky_sessions(router: Router) -> list[int]:
    pool(router, "session", 1, 1, 1)
    routed = [router.route("m", session=s) for s in "abcaab"]
    router.set_state(0, ReplicaState.DRAINING)
    routed += [router.route("m", session=s) for s in "abca"]
    router.remove_replica(1)
    return routed + [router.route("m", session=s) for s in ("a", "b", None, "é-ß-中")]


def evicted_sessions(router: Router) -> list[int]:
    pool(router, "session", 1, 1)
    routed = [router.route("m", session=s) for s in "abacdb"]
    for replica in routed[:3]:
        router.release(replica)
    return routed + [router.route("m", session=s) for s in "abcd"]


def prefix_holders(router: Router) -> list[int]:
    pool(router, "prefix", 1, 1, 1)
    routed = [router.route("m", prefix=p) for p in ((1, 2), (1, 2, 3), (9,), (9, 3), (1,), ())]
    router.set_state(0, ReplicaState.DOWN)
    big = (2**64 - 1, 2**63, 0)
    return routed + [router.route("m", prefix=p) for p in ((1, 2, 3), big, big[:1], (1,))]


def prefix_imbalance(router: Router) -> list[int]:
    pool(router, "prefix", 1, 1)
    routed = [router.route("m", prefix=(5, 6)) for _ in range(5)]
    router.set_policy("m", "prefix", imbalance_threshold=0)
    return routed + [router.route("m", prefix=(5,)) for _ in range(4)]


def aliases(router: Router) -> list[int]:
    router.add_alias("short", "model-name")
    pool(router, "session", 1, 1, model="model-name")
    routed = [router.route(m, session=s) for m, s in (("short", "a"), ("model-name", "b"),
                                                      ("model-name", "a"), ("short", "b"))]
    router.set_policy("short", "round_robin")
    return routed + [router.route("short", session="a") for _ in range(3)]


SCENARIOS = [ties_round_robin, smooth_weighted, sticky_sessions, evicted_sessions,
             prefix_holders, prefix_imbalance, aliases]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_decisions_match(scenario: Scenario) -> None:
    options = {"session_capacity": 3, "prefix_capacity": 4, "imbalance_threshold": 1}
    expected = scenario(PythonRouter(**options))
    assert scenario(CppRouter(**options)) == expected


# --- random operation sequences ---------------------------------------------------------------

# Operations come from a Random that hypothesis seeds, not from st.lists: hypothesis keeps lists
# short (about 6 items), too short to reach e.g. a removal behind the cursor followed by a tie,
# or a full session table. use_true_random makes a draw cost what the stdlib's does, about 100x
# less than a hypothesis-managed one, so 500 runs of 150 calls take about a second. Tiny tables
# make eviction matter. Each of ten hand-made mutants of PythonRouter (LRU order, threshold,
# tie-breaks, cursor moves, scan direction, pool membership, alias rules) failed this test.
NUM_OPERATIONS = 150
MODELS = ("a", "b")
ALIASES = ("x", "y")
# Cumulative-hash chains as prefix_hashes makes them: a shared first block, then each its own.
CHAINS = ((1, 12, 13), (1, 22, 23), (2**64 - 1, 2**63))


class Tables(NamedTuple):
    """Table sizes and the ids and hashes requests draw from."""

    options: dict[str, int]
    sessions: tuple[str | None, ...]
    hashes: tuple[int, ...]
    max_prefix: int


# Tiny tables evict at almost every new entry; wide ones also make the C++ tables grow their
# index (16 buckets hold 8 entries) and shift entries back within long probe runs.
TINY = Tables({"session_capacity": 3, "prefix_capacity": 6, "imbalance_threshold": 0},
              ("s1", "s2", "s3", "s4", None), tuple(sorted({h for c in CHAINS for h in c})), 3)
WIDE = Tables({"session_capacity": 12, "prefix_capacity": 40, "imbalance_threshold": 1},
              (*(f"s{i}" for i in range(20)), None), (*range(60), 2**64 - 1, 2**63), 8)
# Requests come most often: with and without release, so loads both tie and drift apart.
NAMES = ("route_and_release",) * 3 + ("route", "release", "add_replica") * 2 + (
    "remove_replica",
    "set_state",
    "add_alias",
    "set_policy",
    "outstanding",
)


def operations(rng: random.Random, policy: str, tables: Tables) -> Iterator[tuple[Any, ...]]:
    """Both models start with ``policy`` and three replicas, then NUM_OPERATIONS random calls."""
    yield from (("set_policy", model, policy, None) for model in MODELS)
    yield from (("add_replica", MODELS[i % 2], i, rng.choice([1, 2])) for i in range(6))
    for _ in range(NUM_OPERATIONS):
        yield random_operation(rng, tables)


def random_operation(rng: random.Random, tables: Tables) -> tuple[Any, ...]:
    """One call; ids and arguments are sometimes invalid so the errors are compared too."""
    name = rng.choice(NAMES)
    replica = rng.choice([-1, 9]) if rng.random() < 0.1 else rng.randrange(7)
    names = (*MODELS, *ALIASES)
    if name == "add_replica":
        return (name, rng.choice((*MODELS, "a", "x")), replica, rng.choice([1, 1, 2, 3, 0]))
    if name == "set_state":  # mostly UP, so pools keep two or more replicas to choose from
        return (name, replica, rng.choice([ReplicaState.UP, 0, *ReplicaState, 3]))
    if name == "add_alias":
        return (name, rng.choice(names), rng.choice(names))
    if name == "set_policy":
        policy = rng.choice((*POLICIES, "random"))
        return (name, rng.choice(names), policy, rng.choice([None, None, 0, 1, 3, -1]))
    if name in ("route", "route_and_release"):
        if rng.random() < 0.5:
            chain = rng.choice(CHAINS)
            prefix = chain[: rng.randrange(len(chain) + 1)]
        else:  # any hashes in any order: the tables must not care that chains are cumulative
            prefix = tuple(rng.sample(tables.hashes, rng.randrange(tables.max_prefix + 1)))
        model = rng.choice((*names, *MODELS, "unknown"))
        return (name, model, rng.choice(tables.sessions), prefix)
    return (name, replica)


def outcome(router: Router, operation: tuple[Any, ...]) -> tuple[str, Any]:
    """What one call did: its return value or the exact type of the error it raised."""
    name, *args = operation
    try:
        if name == "route_and_release":
            # A request that finishes before the next arrives keeps loads tied, and ties are
            # where the round-robin cursor decides.
            replica = router.route(*args)
            router.release(replica)
            return ("returned", replica)
        return ("returned", getattr(router, name)(*args))
    except Exception as error:  # noqa: BLE001 -- any error type is an outcome to compare
        return ("raised", type(error))


@settings(max_examples=500, deadline=None, database=None)  # no saved examples between runs
@given(st.sampled_from(POLICIES), st.sampled_from([TINY, WIDE]), st.randoms(use_true_random=True))
def test_same_decisions_as_python_router(policy: str, tables: Tables, rng: random.Random) -> None:
    python_router, cpp_router = PythonRouter(**tables.options), CppRouter(**tables.options)
    for step, operation in enumerate(operations(rng, policy, tables)):
        note(f"step {step}: {operation}")
        assert outcome(cpp_router, operation) == outcome(python_router, operation)
    for replica in range(-1, 10):
        operation = ("outstanding", replica)
        assert outcome(cpp_router, operation) == outcome(python_router, operation)
