"""The embed queue's plans: the step's leftover budget, chunks that continue across plans,
short inputs batched, room for the begun inputs, and cancels that drop what was begun."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from laya_core.engine.embed_jobs import EmbedJob, EmbedPlan
from laya_core.engine.embed_queue import EmbedQueue, embed_budget


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Released:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def job(loop: asyncio.AbstractEventLoop, *sizes: int) -> EmbedJob:
    return EmbedJob([list(range(1, n + 1)) for n in sizes], loop, loop.create_future())


def vectors(plan: EmbedPlan) -> list[np.ndarray | None]:
    """What a backend returns: a vector for each last chunk (its input's last position)."""
    return [np.array([1.0, c.start + len(c.tokens)]) if c.last else None for c in plan.chunks]


def run(queue: EmbedQueue, budget: int) -> EmbedPlan:
    plan = queue.plan(budget)
    assert plan is not None
    queue.computed(plan, vectors(plan))
    return plan


def shape(plan: EmbedPlan) -> list[tuple[int, int, int, bool]]:
    return [(c.seq, c.start, len(c.tokens), c.last) for c in plan.chunks]


def test_a_pass_is_a_quarter_of_the_step_budget() -> None:
    assert embed_budget(512) == 128
    assert embed_budget(2) == 1


def test_a_long_input_continues_across_plans(loop: asyncio.AbstractEventLoop) -> None:
    released = Released()
    queue = EmbedQueue(100, 4, True, released)
    j = job(loop, 70)
    queue.add(j)
    assert shape(run(queue, 32)) == [(0, 0, 32, False)]
    assert shape(run(queue, 32)) == [(0, 32, 32, False)]
    assert shape(run(queue, 32)) == [(0, 64, 6, True)]
    assert j.num_done == 1 and released.count == 1 and not queue.has_work
    assert queue.plan(32) is None


def test_short_inputs_share_a_plan_up_to_the_backend_sequences(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(1000, 3, True, Released())
    queue.add(job(loop, *[1] * 7))
    assert shape(run(queue, 64)) == [(0, 0, 1, True), (1, 0, 1, True), (2, 0, 1, True)]
    assert shape(run(queue, 2)) == [(0, 0, 1, True), (1, 0, 1, True)]  # the budget
    assert len(run(queue, 64).chunks) == 2
    assert not queue.has_work


def test_begun_inputs_go_first_and_fit_the_room(loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(100, 8, True, Released())
    first, second = job(loop, 60, 30), job(loop, 20)
    queue.add(first)
    queue.add(second)
    # 60 + 30 fit the 100 tokens of room; the next request's 20 would not, so it waits
    # until the plan that ends the first two has been computed.
    assert shape(run(queue, 50)) == [(0, 0, 50, False)]
    assert shape(run(queue, 50)) == [(0, 50, 10, True), (1, 0, 30, True)]
    assert first.done and not second.done
    assert shape(run(queue, 50)) == [(0, 0, 20, True)]
    assert second.done


def test_without_chunks_each_input_is_whole_and_alone(loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(100, 1, False, Released())
    queue.add(job(loop, 70, 3))
    assert shape(run(queue, 16)) == [(0, 0, 70, True)]  # over the budget, in a plan alone
    assert shape(run(queue, 16)) == [(0, 0, 3, True)]


def test_a_cancel_drops_the_begun_inputs_in_the_next_plan(
        loop: asyncio.AbstractEventLoop) -> None:
    released = Released()
    queue = EmbedQueue(100, 4, True, released)
    gone, kept = job(loop, 50, 50), job(loop, 5)
    queue.add(gone)
    queue.add(kept)
    assert shape(run(queue, 40)) == [(0, 0, 40, False)]
    queue.cancel(gone)
    assert released.count == 1
    plan = run(queue, 40)
    assert plan.dropped == (0,) and shape(plan) == [(0, 0, 5, True)]
    assert kept.done and released.count == 2
    queue.cancel(gone)  # twice, or after it left: nothing
    assert released.count == 2


def test_a_future_cancelled_before_its_cancel_arrives_is_dropped_too(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(100, 4, True, Released())
    j = job(loop, 50)
    queue.add(j)
    run(queue, 10)
    j.future.cancel()
    assert queue.plan(10) is None and not queue.has_work
    queue.add(job(loop, 3))
    assert run(queue, 10).dropped == (0,)


def test_a_failed_plan_fails_only_its_requests(loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(100, 1, True, Released())
    fed, waiting = job(loop, 8), job(loop, 8)
    queue.add(fed)
    queue.add(waiting)
    plan = queue.plan(4)
    assert plan is not None
    queue.failed(plan, RuntimeError("the backend broke"))
    assert fed.failed and not waiting.done
    plan = queue.plan(8)
    assert plan is not None and plan.dropped == (0,) and shape(plan) == [(0, 0, 8, True)]


def test_results_come_in_input_order(loop: asyncio.AbstractEventLoop) -> None:
    queue = EmbedQueue(100, 4, True, Released())
    j = job(loop, 30, 2, 9)
    queue.add(j)
    while queue.has_work:
        run(queue, 7)
    loop.run_until_complete(asyncio.sleep(0))  # the result is set on the loop
    result = j.future.result()
    ends: Sequence[float] = [float(np.frombuffer(v, "<f4")[1]) for v in result.vectors]
    assert ends == pytest.approx([30 / np.hypot(1, 30), 2 / np.hypot(1, 2), 9 / np.hypot(1, 9)])
    assert result.num_tokens == 41
