"""The reference router's policies, tables and errors."""

from __future__ import annotations

import time
from typing import Any

import pytest

from laya_core.routing.router import NoRouteError, PythonRouter, ReplicaState


def make_router(*replicas: tuple[str, int], policy: str | None = None,
                **options: Any) -> PythonRouter:
    router = PythonRouter(**options)
    for model, replica in replicas:
        router.add_replica(model, replica)
    if policy is not None:
        for model in {model for model, _ in replicas}:
            router.set_policy(model, policy)
    return router


def route_many(router: PythonRouter, model: str, num_requests: int, **kwargs: Any) -> list[int]:
    return [router.route(model, **kwargs) for _ in range(num_requests)]


# --- least_outstanding (the default) ----------------------------------------------------------


def test_least_outstanding_ties_go_round_robin_in_insertion_order() -> None:
    router = make_router(("m", 7), ("m", 3), ("m", 5))
    assert route_many(router, "m", 4) == [7, 3, 5, 7]
    router.release(3)
    assert router.route("m") == 3


def test_only_up_replicas_get_requests() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2))
    router.set_state(0, ReplicaState.DRAINING)
    router.set_state(2, ReplicaState.DOWN)
    assert route_many(router, "m", 3) == [1, 1, 1]
    router.set_state(0, ReplicaState.UP)
    assert router.route("m") == 0


def test_remove_keeps_the_cursor_on_the_next_replica() -> None:
    router = make_router(("m", 1), ("m", 2), ("m", 3))
    router.release(router.route("m"))  # cursor now at replica 2
    router.remove_replica(1)
    assert router.route("m") == 2


# --- round_robin ------------------------------------------------------------------------------


def test_round_robin_is_smooth_and_weighted_like_nginx() -> None:
    router = PythonRouter()
    for replica, weight in ((0, 5), (1, 1), (2, 1)):
        router.add_replica("m", replica, weight)
    router.set_policy("m", "round_robin")
    assert route_many(router, "m", 7) == [0, 0, 1, 0, 2, 0, 0]


def test_round_robin_ignores_load_and_skips_replicas_not_up() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2), policy="round_robin")
    router.set_state(1, ReplicaState.DOWN)
    assert route_many(router, "m", 4) == [0, 2, 0, 2]
    router.release(2)
    router.release(2)  # replica 2 is idle now, 0 is not: no matter
    assert route_many(router, "m", 2) == [0, 2]


# --- session ----------------------------------------------------------------------------------


def test_a_session_sticks_to_its_replica_whatever_the_load() -> None:
    router = make_router(("m", 0), ("m", 1), policy="session")
    assert route_many(router, "m", 3, session="alice") == [0, 0, 0]
    assert router.route("m", session="bob") == 1
    assert route_many(router, "m", 2) == [1, 1]  # no session: least outstanding


def test_a_session_moves_when_its_replica_goes_and_stays_moved() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2), policy="session")
    assert router.route("m", session="alice") == 0
    router.set_state(0, ReplicaState.DRAINING)
    assert router.route("m", session="alice") == 1
    router.set_state(0, ReplicaState.UP)
    assert router.route("m", session="alice") == 1
    router.remove_replica(1)
    assert router.route("m", session="alice") == 2


def test_sessions_are_bounded_least_recently_used_first_out() -> None:
    router = make_router(("m", 0), ("m", 1), policy="session", session_capacity=2)
    assert [router.route("m", session=s) for s in ("a", "b", "a", "c")] == [0, 1, 0, 1]
    # "a" was used after "b", so "c" pushed "b" out.
    router.release(1)
    router.release(1)
    assert router.route("m", session="a") == 0  # remembered, though replica 1 is idle
    for _ in range(3):
        router.release(0)
    assert router.route("m", session="b") == 0  # decided afresh: it was on replica 1


def test_an_expired_session_is_decided_afresh() -> None:
    router = make_router(("m", 0), ("m", 1), policy="session", session_ttl_s=0.001)
    assert router.route("m", session="a") == 0
    time.sleep(0.01)
    assert router.route("m", session="a") == 1
    kept = make_router(("m", 0), ("m", 1), policy="session", session_ttl_s=3600)
    assert route_many(kept, "m", 2, session="a") == [0, 0]


# --- prefix -----------------------------------------------------------------------------------


def test_the_longest_matching_prefix_wins() -> None:
    router = make_router(("m", 0), ("m", 1), ("m", 2), policy="prefix")
    assert router.route("m", prefix=(1, 2)) == 0
    assert router.route("m", prefix=(1, 2, 3, 4)) == 0  # holder of (1, 2); now also of 3, 4
    assert router.route("m", prefix=(9,)) == 1
    router.release(0)
    router.release(0)
    assert router.route("m", prefix=(1, 2, 3, 5)) == 0
    assert router.route("m", prefix=(9, 3)) == 0  # 3 is the longer match, held by 0


def test_a_loaded_prefix_holder_gives_way_beyond_the_imbalance_threshold() -> None:
    router = make_router(("m", 0), ("m", 1), policy="prefix", imbalance_threshold=1)
    assert route_many(router, "m", 2, prefix=(5,)) == [0, 0]  # 0 vs 0, then 1 vs 0
    assert router.route("m", prefix=(5,)) == 1  # 2 vs 0: beyond 1, least outstanding wins
    assert router.route("m", prefix=(5,)) == 1  # the prefix moved with it
    router.release(0)
    router.set_policy("m", "prefix", imbalance_threshold=0)
    assert router.route("m", prefix=(5,)) == 0  # holder 1 at 2, replica 0 at 1


def test_prefixes_of_replicas_not_up_are_ignored() -> None:
    router = make_router(("m", 0), ("m", 1), policy="prefix")
    assert router.route("m", prefix=(1, 2)) == 0
    assert router.route("m", prefix=(1,)) == 0
    router.set_state(0, ReplicaState.DOWN)
    assert router.route("m", prefix=(1, 2)) == 1


def test_the_prefix_index_is_bounded() -> None:
    router = make_router(("m", 0), ("m", 1), policy="prefix", prefix_capacity=2)
    assert router.route("m", prefix=(1,)) == 0
    assert router.route("m", prefix=(2, 3)) == 1  # full: forgets 1
    router.release(1)
    assert router.route("m", prefix=(1,)) == 1  # least outstanding; forgets 2
    router.release(0)
    assert router.route("m", prefix=(3,)) == 1  # still held by 1, though 0 is idle


# --- aliases and policies ---------------------------------------------------------------------


def test_an_alias_shares_its_models_pool_and_tables() -> None:
    router = make_router(("model-name", 0), ("model-name", 1), policy="session")
    router.add_alias("short", "model-name")
    assert router.route("short", session="a") == 0
    assert router.route("model-name", session="b") == 1
    assert router.route("model-name", session="a") == 0
    router.set_policy("short", "round_robin")  # sets the model's policy
    assert route_many(router, "model-name", 2, session="a") == [0, 1]


def test_an_alias_may_come_before_its_model_has_replicas() -> None:
    router = PythonRouter()
    router.add_alias("short", "model-name")
    with pytest.raises(NoRouteError, match="'short' has no replica up"):
        router.route("short")
    router.add_replica("model-name", 4)
    assert router.route("short") == 4


@pytest.mark.parametrize(
    ("alias", "model", "message"),
    [("m", "m", "to itself"), ("a", "other", "already an alias"), ("m", "other", "model name"),
     ("b", "a", "is an alias")],
)
def test_bad_aliases_raise_value_error(alias: str, model: str, message: str) -> None:
    router = make_router(("m", 0))
    router.add_alias("a", "m")
    with pytest.raises(ValueError, match=message):
        router.add_alias(alias, model)


def test_replicas_are_added_to_models_not_aliases() -> None:
    router = make_router(("m", 0))
    router.add_alias("a", "m")
    with pytest.raises(ValueError, match="'a' is an alias of 'm'"):
        router.add_replica("a", 1)


def test_a_policy_outlives_the_replicas() -> None:
    router = make_router(("m", 0), ("m", 1), policy="round_robin")
    router.remove_replica(0)
    router.remove_replica(1)
    with pytest.raises(NoRouteError, match="no replica up"):
        router.route("m")
    router.add_replica("m", 0, weight=2)
    router.add_replica("m", 1)
    router.set_state(1, ReplicaState.UP)
    assert route_many(router, "m", 3) == [0, 1, 0]


@pytest.mark.parametrize(("policy", "threshold"), [("fastest", None), ("prefix", -1)])
def test_bad_policies_raise_value_error(policy: str, threshold: int | None) -> None:
    with pytest.raises(ValueError):
        make_router(("m", 0)).set_policy("m", policy, threshold)


@pytest.mark.parametrize(
    "options",
    [{"session_capacity": 0}, {"prefix_capacity": 0}, {"session_ttl_s": 0},
     {"imbalance_threshold": -1}],
)
def test_bad_options_raise_value_error(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PythonRouter(**options)


def test_errors_say_what_is_wrong() -> None:
    router = make_router(("m", 0))
    with pytest.raises(NoRouteError, match="no model named 'other'"):
        router.route("other")
    with pytest.raises(KeyError):
        router.release(9)
    with pytest.raises(ValueError, match="no outstanding request"):
        router.release(0)
    with pytest.raises(ValueError, match="already exists"):
        router.add_replica("other", 0)
