"""tools/profile_token.py: its arguments, the /metrics it reads, and the breakdown it prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profile_token.py"
spec = importlib.util.spec_from_file_location("profile_token", TOOL)
assert spec and spec.loader
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)

METRICS = """\
# TYPE laya:engine_layer_seconds_total counter
laya:engine_layer_seconds_total{model_name="m",replica="0",layer="backend"} 1.5
laya:engine_layer_seconds_total{model_name="m",replica="1",layer="backend"} 0.5
laya:engine_layer_seconds_total{model_name="m",replica="0",layer="http"} 0.25
laya:engine_layer_seconds_total{model_name="other",replica="0",layer="http"} 9.0
# TYPE laya:engine_steps_total counter
laya:engine_steps_total{model_name="m",replica="0"} 40.0
# TYPE laya:engine_generated_tokens_total counter
laya:engine_generated_tokens_total{model_name="m",replica="0"} 80.0
"""


def sample(tokens: float, steps: float, **seconds: float) -> dict[str, float]:
    return {"tokens": tokens, "steps": steps, **seconds}


def test_arguments_and_their_defaults() -> None:
    args = profile.parse_args([])
    assert args.backend == ["llamacpp"] and args.concurrency == [1, 8]
    assert args.max_tokens == 128 and args.options == {}
    args = profile.parse_args(["--backend", "llamacpp", "--backend", "torch",
                               "--concurrency", "1,8", "--options", '{"n_threads": 2}'])
    assert args.backend == ["llamacpp", "torch"] and args.options == {"n_threads": 2}
    with pytest.raises(SystemExit):
        profile.parse_args(["--options", "[1]"])
    with pytest.raises(SystemExit):
        profile.parse_args(["--backend", "vllm"])


def test_counters_sum_a_models_replicas() -> None:
    got = profile.counters(METRICS, "m")
    assert got == {"backend": 2.0, "http": 0.25, "steps": 40.0, "tokens": 80.0}


def test_breakdown_per_token_with_windows_and_residue() -> None:
    samples = [sample(0, 0),
               sample(100, 50, backend=1.0, http=0.1),   # window 1: 10 ms, 1 ms a token
               sample(200, 100, backend=3.0, http=0.2),  # window 2: 20 ms, 1 ms
               sample(200, 100, backend=3.0, http=0.2)]  # no tokens: no window
    b = profile.breakdown(samples, [0.030] * 10 + [0.050] * 10, wall_s=4.0)
    assert b["tokens"] == 200 and b["steps"] == 100 and b["tokens_per_step"] == 2.0
    assert b["windows"] == 2 and b["wall_ms_per_token"] == 20.0
    assert b["layers"]["backend"] == {"thread": "engine", "mean_ms": 15.0, "p50_ms": 15.0,
                                      "p90_ms": 19.0}
    assert b["layers"]["http"]["mean_ms"] == 1.0 and b["layers"]["loop"]["mean_ms"] == 0.0
    assert b["measured_ms"] == 16.0
    assert b["itl_ms"] == {"mean": 20.0, "p50": 20.0, "p90": 25.0}  # 40 ms a gap, 2 a step
    assert b["residue_ms"] == 4.0


def test_report_prints_every_layer_then_the_sums() -> None:
    samples = [sample(0, 0), sample(10, 10, backend=0.1, prefill=0.02, http=0.005)]
    lines = profile.report("llamacpp", 1, profile.breakdown(samples, [0.012] * 9, 0.15))
    assert lines[0] == ("llamacpp c=1: 10 tokens in 10 steps (1.00 a step), wall 15.000 "
                        "ms/token")
    n = len(profile.LAYERS)
    assert [line.split()[0] for line in lines[2:2 + n]] == list(profile.LAYERS)
    assert lines[2 + list(profile.LAYERS).index("prefill")].split() == [
        "prefill", "engine", "2.000", "2.000", "2.000"]
    assert lines[-4].split() == ["measured", "12.500"]
    assert lines[-3].split() == ["but", "prefill", "10.500"]
    assert lines[-1].split() == ["residue", "1.500"]


def test_thread_cpu_names_laya_threads_and_sums_their_time() -> None:
    """The CPU of a process tree's threads, by the names the OS shows: a thread Laya named
    and the main one, read from /proc, and the time between two readings."""
    import threading
    import time

    import psutil

    from laya_core.logs import start_named

    def burn() -> None:  # 0.1 s of this thread's own CPU: ten of /proc's ticks
        start = time.thread_time()
        while time.thread_time() - start < 0.1:
            pass

    before = profile.thread_cpu_s(psutil.Process())
    assert "front/main" in {name for name, _ in before.values()}
    hold = threading.Event()  # the thread stays, so that /proc still lists it

    def burn_and_hold() -> None:
        burn()
        hold.wait(60)

    thread = start_named(threading.Thread(target=burn_and_hold), "laya-burn")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            spent = profile.thread_cpu_spent(before, profile.thread_cpu_s(psutil.Process()))
            if spent.get("front/laya-burn", 0) >= 0.05:
                break
            time.sleep(0.05)
        assert spent["front/laya-burn"] >= 0.05, spent
    finally:
        hold.set()
        thread.join(60)


def test_report_lists_the_cpu_of_each_thread() -> None:
    b = profile.breakdown([sample(0, 0, backend=0.0), sample(10, 10, backend=0.1)],
                          [0.012] * 9, 0.15)
    b["threads_cpu_ms"] = {"worker/laya-engine": 10.5, "front/main": 0.25}
    lines = profile.report("llamacpp", 1, b)
    assert lines[-3].endswith("total 10.750:")
    assert lines[-2].split() == ["worker/laya-engine", "10.500"]
    assert lines[-1].split() == ["front/main", "0.250"]
