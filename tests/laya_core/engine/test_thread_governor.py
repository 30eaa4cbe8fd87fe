"""The thread governor: every core while the cores are free, fewer while others hold them."""

from __future__ import annotations

import pytest

from laya_core.engine.threads import ThreadGovernor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(governor: ThreadGovernor, clock: Clock, share: float, seconds: float) -> list[int]:
    """Decodes of 10 ms each whose calling thread was on a CPU ``share`` of the time; returns
    the thread counts the governor changed to."""
    changes = []
    for _ in range(round(seconds / 0.01)):
        clock.now += 0.01
        changed = governor.record(0.01, 0.01 * share)
        if changed is not None:
            changes.append(changed)
    return changes


def test_free_cores_keep_every_thread() -> None:
    clock = Clock()
    governor = ThreadGovernor(4, clock=clock)
    assert run(governor, clock, 0.99, 10) == []
    assert governor.threads == 4


def test_sustained_contention_drops_one_thread_at_a_time_down_to_one() -> None:
    clock = Clock()
    governor = ThreadGovernor(3, clock=clock)
    assert run(governor, clock, 0.5, 0.5) == []  # two low windows: not yet
    assert run(governor, clock, 0.5, 0.75) == [2, 1]  # the third, then three more
    assert run(governor, clock, 0.5, 1.0) == []  # one thread cannot go lower
    assert governor.threads == 1 and governor.num_drops == 2


def test_a_moment_of_contention_changes_nothing() -> None:
    clock = Clock()
    governor = ThreadGovernor(2, clock=clock)
    for _ in range(10):  # two low windows, then a normal one, again and again
        assert run(governor, clock, 0.5, 0.4) + run(governor, clock, 1.0, 0.2) == []
    assert governor.threads == 2


def test_a_dropped_thread_comes_back_once_the_cores_are_free() -> None:
    clock = Clock()
    governor = ThreadGovernor(2, probe_after_s=4.0, clock=clock)
    run(governor, clock, 0.5, 0.6)
    assert governor.threads == 1
    assert run(governor, clock, 1.0, 3.5) == []  # not offered before probe_after_s
    assert run(governor, clock, 1.0, 1.0) == [2]
    assert run(governor, clock, 1.0, 5.0) == []  # the probe held: kept
    assert governor.threads == 2


def test_a_failed_probe_waits_twice_as_long_before_the_next() -> None:
    clock = Clock()
    governor = ThreadGovernor(2, probe_after_s=4.0, max_probe_after_s=8.0, clock=clock)
    run(governor, clock, 0.5, 0.6)
    # Still contended: each offer of the second thread is taken back after one window.
    assert run(governor, clock, 0.6, 4.5) == [2, 1]
    assert run(governor, clock, 0.6, 7.5) == []  # the next offer comes 8 s later
    assert run(governor, clock, 0.6, 1.0) == [2, 1]
    assert run(governor, clock, 0.6, 8.5) == [2, 1]  # capped at max_probe_after_s


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(0)
