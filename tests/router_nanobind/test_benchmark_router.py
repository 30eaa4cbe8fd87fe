"""tools/benchmark_router.py run as a user would: numbers on screen, JSON on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the tool

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmark_router.py"


def test_prints_numbers_then_json_on_the_last_line() -> None:
    out = subprocess.run(
        [sys.executable, str(TOOL), "--requests", "400", "--threads", "4", "--impl", "both",
         "--policy", "session"],
        check=True, capture_output=True, text=True, timeout=60,
    )
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("python router") for line in lines)
    assert "p99.9" in out.stdout and "decisions/s" in out.stdout
    result = json.loads(lines[-1])
    assert {"impl", "threads", "requests", "avg_us", "p50_us", "p99_us", "p999_us",
            "decisions_per_s"} <= result.keys()
    assert (result["impl"], result["threads"], result["requests"]) == ("cpp", 4, 400)
    assert 0 < result["p50_us"] <= result["p99_us"] <= result["p999_us"]
    assert result["decisions_per_s"] > 0 and result["speedup_vs_python"] > 0


def test_refuses_fewer_requests_than_threads() -> None:
    out = subprocess.run([sys.executable, str(TOOL), "--requests", "2", "--threads", "4"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--requests >= --threads" in out.stderr
