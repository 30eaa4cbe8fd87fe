"""The C++ router (plugin ``laya-router``): its Python face, errors, TTL and registration.

Its decisions are compared with PythonRouter's in test_same_decisions.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from laya_router import CppRouter

from laya_core.plugins import load_registry
from laya_core.routing import router as core
from laya_core.kv.hashing import prefix_hashes
from laya_core.routing.router import NoRouteError, ReplicaState, Router


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


def test_registered_as_cpp_by_the_laya_router_distribution() -> None:
    registered = load_registry().routers["cpp"]
    assert registered.obj is CppRouter
    assert registered.source.startswith("laya-router ")
    assert "entry point" in registered.source


def test_protocol_keyword_arguments_of_the_new_calls() -> None:
    router: Router = CppRouter(session_capacity=8, session_ttl_s=60, prefix_capacity=8,
                               imbalance_threshold=0)
    router.add_replica("m", 0)
    router.add_alias(alias="a", model="m")
    router.set_policy(model="a", policy="prefix", imbalance_threshold=None)
    hashes = prefix_hashes(list(range(64)))
    assert router.route(model="a", session="s", prefix=hashes) == 0
    assert router.route("a", "s", list(hashes)) == 0  # any sequence of ints


@pytest.mark.parametrize(
    "call",
    [
        lambda router: router.add_alias("m", "m"),
        lambda router: router.add_alias("m", "other"),
        lambda router: router.add_replica("a", 1),
        lambda router: router.set_policy("m", "fastest"),
        lambda router: router.set_policy("m", "prefix", -1),
        lambda router: CppRouter(session_capacity=0),
        lambda router: CppRouter(session_ttl_s=0.0),
        lambda router: CppRouter(imbalance_threshold=-1),
    ],
)
def test_misuse_raises_value_error(call: Callable[[CppRouter], Any]) -> None:
    router = make_router(("m", 0))
    router.add_alias("a", "m")
    with pytest.raises(ValueError):
        call(router)


def test_a_prefix_that_is_not_unsigned_64_bit_ints_raises_type_error() -> None:
    router = make_router(("m", 0))
    for prefix in ([-1], [2**64], ["a"], 5):
        with pytest.raises(TypeError):
            router.route("m", None, prefix)  # type: ignore[arg-type]


def test_any_unicode_session_id() -> None:
    router = make_router(("m", 0), ("m", 1))
    router.set_policy("m", "session")
    assert [router.route("m", session=s) for s in ("é-中-🙂", "", "é-中-🙂")] == [0, 1, 0]


def test_sessions_expire_after_the_ttl() -> None:
    router = CppRouter(session_ttl_s=0.001)
    router.add_replica("m", 0)
    router.add_replica("m", 1)
    router.set_policy("m", "session")
    assert router.route("m", session="a") == 0
    time.sleep(0.01)
    assert router.route("m", session="a") == 1


def test_defaults_are_the_cores() -> None:
    signature = CppRouter.__init__.__doc__ or ""  # nanobind puts the signature there
    defaults = {name: int(value) for name, value in re.findall(r"(\w+): int = (\d+)", signature)}
    assert defaults == {"session_capacity": core.DEFAULT_SESSION_CAPACITY,
                        "prefix_capacity": core.DEFAULT_PREFIX_CAPACITY,
                        "imbalance_threshold": core.DEFAULT_IMBALANCE_THRESHOLD}
