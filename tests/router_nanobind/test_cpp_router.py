"""The C++ router (plugin ``laya-router``) makes exactly the decisions of PythonRouter."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from laya_router import CppRouter

from laya_core.plugins import load_registry
from laya_core.router import NoRouteError, PythonRouter, ReplicaState, Router


def make_router(*replicas: tuple[str, int]) -> CppRouter:
    router = CppRouter()
    for model, replica in replicas:
        router.add_replica(model, replica)
    return router


def route_many(router: Router, model: str, num_requests: int) -> list[int]:
    return [router.route(model) for _ in range(num_requests)]


# --- unit tests -------------------------------------------------------------------------------


def test_ties_go_round_robin_in_insertion_order() -> None:
    router = make_router(("m", 7), ("m", 3), ("m", 5))
    assert route_many(router, "m", 3) == [7, 3, 5]
    for replica in (7, 3, 5):
        router.release(replica)
    assert route_many(router, "m", 3) == [7, 3, 5]


def test_least_outstanding_wins() -> None:
    router = make_router(("m", 0), ("m", 1))
    assert route_many(router, "m", 2) == [0, 1]
    router.release(1)
    assert router.route("m") == 1
    assert (router.outstanding(0), router.outstanding(1)) == (1, 1)


def test_models_have_separate_pools_and_cursors() -> None:
    router = make_router(("a", 0), ("b", 1), ("a", 2))
    assert router.route("b") == 1
    assert route_many(router, "a", 2) == [0, 2]


def test_only_up_replicas_get_requests() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2))
    router.set_state(0, ReplicaState.DRAINING)
    router.set_state(2, int(ReplicaState.DOWN))
    assert route_many(router, "m", 3) == [1, 1, 1]
    router.set_state(0, ReplicaState.UP)
    assert router.route("m") == 0


def test_no_route_raises_the_core_error() -> None:
    router = make_router(("m", 0))
    with pytest.raises(NoRouteError, match="no model named 'other'"):
        router.route("other")
    router.set_state(0, ReplicaState.DOWN)
    with pytest.raises(NoRouteError, match="no replica up") as caught:
        router.route("m")
    assert type(caught.value) is NoRouteError


def test_remove_keeps_the_cursor_on_the_next_replica() -> None:
    router = make_router(("m", 1), ("m", 2), ("m", 3))
    router.release(router.route("m"))  # cursor now at replica 2
    router.remove_replica(1)  # entries shift left; the cursor follows replica 2
    assert router.route("m") == 2


def test_remove_wraps_a_cursor_past_the_end() -> None:
    router = make_router(("m", 1), ("m", 2), ("m", 3))
    router.release(router.route("m"))
    router.release(router.route("m"))  # cursor now at replica 3
    router.remove_replica(3)
    assert router.route("m") == 1


def test_removing_the_last_replica_forgets_the_model() -> None:
    router = make_router(("m", 0))
    router.remove_replica(0)
    with pytest.raises(NoRouteError):
        router.route("m")
    router.add_replica("m", 0)  # the id is free again
    assert router.route("m") == 0


@pytest.mark.parametrize(
    ("replica", "weight", "message"),
    [(-1, 1, "replica ids are >= 0"), (0, 0, "weight must be >= 1"), (5, 1, "already exists")],
)
def test_bad_add_replica_raises_value_error(replica: int, weight: int, message: str) -> None:
    router = make_router(("m", 5))
    with pytest.raises(ValueError, match=message):
        router.add_replica("m", replica, weight)


def test_release_without_outstanding_raises_value_error() -> None:
    router = make_router(("m", 0))
    with pytest.raises(ValueError, match="no outstanding request"):
        router.release(0)


def test_invalid_state_raises_value_error() -> None:
    router = make_router(("m", 0))
    with pytest.raises(ValueError):
        router.set_state(0, 3)


@pytest.mark.parametrize(
    "call",
    [
        lambda router: router.remove_replica(9),
        lambda router: router.set_state(9, ReplicaState.UP),
        lambda router: router.release(9),
        lambda router: router.outstanding(9),
    ],
)
def test_unknown_replica_raises_key_error(call: Callable[[CppRouter], Any]) -> None:
    with pytest.raises(KeyError) as caught:
        call(make_router(("m", 0)))
    assert caught.value.args == (9,)


def test_protocol_keyword_arguments() -> None:
    router: Router = CppRouter()
    router.add_replica(model="m", replica=0, weight=2)
    router.set_state(replica=0, state=ReplicaState.UP)
    assert router.route(model="m", session="s") == 0
    router.release(replica=0)
    assert router.outstanding(replica=0) == 0
    router.remove_replica(replica=0)


def test_concurrent_route_and_release_keep_counts_true() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2))
    num_threads, num_rounds = 8, 2_000

    def work() -> None:
        for _ in range(num_rounds):
            router.release(router.route("m"))

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [router.outstanding(replica) for replica in (0, 1, 2)] == [0, 0, 0]


def test_registered_as_cpp_by_the_laya_router_distribution() -> None:
    registered = load_registry().routers["cpp"]
    assert registered.obj is CppRouter
    assert registered.source.startswith("laya-router ")
    assert "entry point" in registered.source


# --- the same decisions as PythonRouter -------------------------------------------------------

# Operations are drawn from a seeded Random rather than built with st.lists: hypothesis keeps
# lists short (about 6 items), too short to reach e.g. a removal behind the cursor followed by a
# tie. Runs of 60 operations caught every mutant router tried (cursor, tie and state bugs).
NUM_OPERATIONS = 60
MODELS = ("a", "b")
# Adding and short requests come twice as often as the other calls: they build pools and ties.
NAMES = ("add_replica", "route_and_release") * 2 + (
    "remove_replica",
    "set_state",
    "route",
    "release",
    "outstanding",
)


def random_operation(rng: random.Random) -> tuple[Any, ...]:
    """One call; ids and arguments are sometimes invalid so the errors are compared too."""
    name = rng.choice(NAMES)
    replica = rng.choice([-1, 7]) if rng.random() < 0.1 else rng.randrange(5)
    if name == "add_replica":
        return (name, rng.choice(MODELS), replica, rng.choice([1, 1, 1, 2, 0]))
    if name == "set_state":
        return (name, replica, rng.choice([*ReplicaState, 0, 3]))
    if name in ("route", "route_and_release"):
        return (name, rng.choice([*MODELS, "a", "unknown"]))
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


@settings(max_examples=300, deadline=None, database=None)  # no saved examples between runs
@given(st.randoms(use_true_random=False))
def test_same_decisions_as_python_router(rng: random.Random) -> None:
    python_router, cpp_router = PythonRouter(), CppRouter()
    for step in range(NUM_OPERATIONS):
        operation = random_operation(rng)
        note(f"step {step}: {operation}")
        assert outcome(cpp_router, operation) == outcome(python_router, operation)
    for replica in range(-1, 8):
        operation = ("outstanding", replica)
        assert outcome(cpp_router, operation) == outcome(python_router, operation)
