"""The live page's tokens/s (laya_core/http/dashboard.py, LatencyWindow.tokens_per_s) against a
clock the test moves: the rate must not depend on how often /live is polled."""

from __future__ import annotations

import pytest

from laya_core.http.dashboard import LatencyWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def polls(every_s: float, count: int, tokens_per_s: float,
          window: LatencyWindow, clock: Clock, generated: int = 0) -> list[float]:
    """The rates ``count`` polls read ``every_s`` apart while tokens come at a steady rate."""
    rates = []
    for _ in range(count):
        rates.append(window.tokens_per_s("m", generated))
        clock.now += every_s
        generated += round(tokens_per_s * every_s)
    return rates


def test_fast_polls_read_the_rate() -> None:
    clock = Clock()
    window = LatencyWindow(clock)
    rates = polls(0.5, 20, 60, window, clock)
    assert rates[0] == 0.0  # nothing to measure against yet
    assert rates[1:] == [60.0] * 19


def test_polls_3_s_or_more_apart_read_the_rate() -> None:
    for every_s in (3.0, 3.5, 10.0, 120.0):
        clock = Clock()
        window = LatencyWindow(clock)
        rates = polls(every_s, 5, 50, window, clock)
        assert rates[1:] == [50.0] * 4, every_s


def test_the_rate_falls_to_0_once_idle() -> None:
    for every_s in (0.5, 4.0):
        clock = Clock()
        window = LatencyWindow(clock)
        polls(every_s, 8, 40, window, clock)
        idle = polls(every_s, 10, 0, window, clock, generated=10_000)
        assert idle[-1] == 0.0 and idle[0] > 0, (every_s, idle)


def test_slow_and_fast_pollers_together() -> None:
    """A page at 0.5 s and a script at 5 s share the history; both read the same rate."""
    clock = Clock()
    window = LatencyWindow(clock)
    generated = 0
    for step in range(1, 41):
        clock.now += 0.5
        generated += 35
        rate = window.tokens_per_s("m", generated)
        if step > 1:
            assert rate == 70.0, step
        if step % 10 == 0:
            assert window.tokens_per_s("m", generated) == 70.0  # the script, same instant


def test_polls_closer_than_the_minimum_measure_nothing() -> None:
    """Two polls 10 ms apart (two pages opened together) do not read 1 token as 100/s."""
    clock = Clock()
    window = LatencyWindow(clock)
    assert window.tokens_per_s("m", 0) == 0.0
    clock.now += 0.01
    assert window.tokens_per_s("m", 1) == 0.0  # the rate read before stands
    clock.now += 0.49
    assert window.tokens_per_s("m", 20) == pytest.approx(40.0)  # from the first poll
    clock.now += 0.01
    assert window.tokens_per_s("m", 21) == pytest.approx(21 / 0.51)  # still from the first


def test_a_restarted_replica_starts_the_history_again() -> None:
    clock = Clock()
    window = LatencyWindow(clock)
    polls(0.5, 6, 30, window, clock, generated=5000)
    assert window.tokens_per_s("m", 3) == 0.0  # the counter began anew: no negative rate
    clock.now += 0.5
    assert window.tokens_per_s("m", 18) == 30.0
