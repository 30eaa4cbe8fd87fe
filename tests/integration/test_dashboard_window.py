"""The live page's latency window (laya_core/http/dashboard.py): percentiles, tokens/s and its
bounds, on a fake clock. Pure logic; it sits beside test_dashboard.py, the browser test."""

from __future__ import annotations

from laya_core.http.dashboard import MAX_SAMPLES, WINDOW_S, LatencyWindow
from laya_core.types import Timing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_empty_window_has_no_percentiles_and_no_rate() -> None:
    summary = LatencyWindow(Clock()).summary("m")
    assert summary["sequences"] == 0 and summary["tokens_per_s"] == 0.0
    assert summary["decode_ms"] == {"p50": None, "p99": None}


def test_percentiles_are_nearest_rank_in_milliseconds_per_layer() -> None:
    window = LatencyWindow(Clock())
    for i in range(1, 101):  # decode 1..100 ms, prefill ten times that
        window.add("m", 0.0001, Timing(0.0, i / 100, i / 1000))
    summary = window.summary("m")
    assert summary["decode_ms"]["p50"] == 50.0 and summary["decode_ms"]["p99"] == 99.0
    assert summary["prefill_ms"]["p50"] == 500.0
    assert summary["route_ms"]["p99"] == 0.1
    assert window.summary("other")["sequences"] == 0


def test_old_samples_leave_the_window() -> None:
    clock = Clock()
    window = LatencyWindow(clock)
    window.add("m", 0.0, Timing(0.0, 0.0, 0.0))
    clock.now += 10
    window.add("m", 0.0, Timing(0.0, 0.0, 0.0))
    assert window.summary("m")["sequences"] == 2
    clock.now += WINDOW_S - 5
    assert window.summary("m")["sequences"] == 1
    clock.now += WINDOW_S
    assert window.summary("m")["sequences"] == 0


def test_tokens_per_s_follows_the_counters_between_polls() -> None:
    """Live: tokens of sequences still running count, over the last RATE_S of polls; a
    replica whose count starts again (a restarted worker) does not read as negative."""
    clock = Clock()
    window = LatencyWindow(clock)
    assert window.tokens_per_s("m", 100) == 0.0  # one poll: no rate yet
    clock.now += 0.5
    assert window.tokens_per_s("m", 150) == 100.0
    clock.now += 0.5
    assert window.tokens_per_s("m", 250) == 150.0  # 150 tokens over the last second
    for _ in range(10):
        clock.now += 0.5
        window.tokens_per_s("m", 250)
    assert window.tokens_per_s("m", 250) == 0.0  # idle for longer than RATE_S
    clock.now += 0.5
    assert window.tokens_per_s("m", 20) == 0.0  # restarted: the history begins again
    clock.now += 1.0
    assert window.tokens_per_s("m", 60) == 40.0


def test_a_burst_cannot_grow_the_window_past_its_bound() -> None:
    window = LatencyWindow(Clock())
    for _ in range(MAX_SAMPLES * 3):
        window.add("m", 0.0, Timing(0.0, 0.0, 0.0))
    assert window.summary("m")["sequences"] == MAX_SAMPLES
