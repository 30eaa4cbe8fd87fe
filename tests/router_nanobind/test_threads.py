"""Many threads share one CppRouter: every policy, table changes meanwhile, counts end true."""

from __future__ import annotations

import random
import sys
import threading
from collections import deque
from collections.abc import Iterator

import pytest
from laya_router import CppRouter

from laya_core.routing.router import ReplicaState

NUM_WORKERS = 12
NUM_ROUNDS = 1_500
# (model, policy, replicas); "long" is asked for by its alias too.
POOLS = (("sessions", "session", (0, 1)), ("prefixes", "prefix", (2, 3, 4)),
         ("weighted", "round_robin", (5, 6)), ("long", "least_outstanding", (7,)))
REQUESTS = ("sessions", "prefixes", "weighted", "long", "long-alias")


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Switch threads every 10 µs instead of 5 ms, so their calls interleave far more."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def make_router() -> CppRouter:
    router = CppRouter(session_capacity=64, prefix_capacity=256)
    for model, policy, replicas in POOLS:
        for replica in replicas:
            router.add_replica(model, replica, weight=1 + replica % 3)
        router.set_policy(model, policy)
    router.add_alias("long-alias", "long")
    return router


def requests_in_flight(router: CppRouter, seed: int) -> None:
    """Route with up to 4 requests in flight, releasing the oldest; release all at the end."""
    rng = random.Random(seed)
    in_flight: deque[int] = deque()
    for round_ in range(NUM_ROUNDS):
        model = rng.choice(REQUESTS)
        prefix = (1, 100 + rng.randrange(20), 1_000 + round_ % 7)[: rng.randrange(4)]
        in_flight.append(router.route(model, f"user-{rng.randrange(200)}", prefix))
        if len(in_flight) > rng.randrange(5):
            router.release(in_flight.popleft())
    while in_flight:
        router.release(in_flight.popleft())


def change_tables(router: CppRouter, done: threading.Event) -> None:
    """Admin calls while requests run: states, policies, new names and replicas nobody asks for."""
    for step in range(10**6):
        if done.is_set():
            return
        router.set_state(1, ReplicaState.DRAINING if step % 2 else ReplicaState.UP)
        router.set_policy("weighted", "least_outstanding" if step % 2 else "round_robin")
        router.add_alias(f"alias-{step}", f"spare-{step % 5}")
        router.add_replica(f"spare-{step % 5}", 1_000 + step)
        if step >= 3:
            router.remove_replica(1_000 + step - 3)


def test_counts_end_at_zero_under_many_threads(frequent_switches: None) -> None:
    router = make_router()
    workers = [threading.Thread(target=requests_in_flight, args=(router, seed))
               for seed in range(NUM_WORKERS)]
    done = threading.Event()
    admin = threading.Thread(target=change_tables, args=(router, done))
    admin.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    admin.join()
    replicas = [replica for _, _, pool in POOLS for replica in pool]
    assert [router.outstanding(replica) for replica in replicas] == [0] * len(replicas)
    # Still routing as set up: the draining replica 1 is up again or not, 0 always is.
    assert router.route("sessions", "user-0") in (0, 1)
