"""tools/wake_cost.py: the CPU a wake-up costs, measured four ways, each round printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "wake_cost.py"


def test_it_measures_each_way_in_each_round() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--messages", "40", "--gap-ms", "1",
                          "--rounds", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["gap_ms"] == 1.0 and result["messages"] == 40
    us = result["us_cpu"]
    assert set(us) == {"sleep", "ping-pong", "socket->thread->loop", "socket->loop"}
    for name, values in us.items():  # every message arrived (or the run would not end)
        assert len(values) == 2 and all(v > 0 for v in values), (name, values)


def test_bad_arguments_are_refused_by_name() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--gap-ms", "0"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--gap-ms" in run.stderr
