"""tools/overhead_per_token.py: a real server with an instant backend, its CPU per token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "overhead_per_token.py"


def test_it_serves_every_token_and_charges_each_layer() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--requests", "3", "--max-tokens", "400"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["engine"] == "process"
    # Every token arrives; those the engine held for the next steps' share their chunk.
    assert result["tokens"] == 1200 and 0 < result["chunks"] < 1200
    # /proc counts CPU time in ticks of 10 ms: enough tokens that the server spends some
    assert result["server_cpu_us_per_token"] > 0 and result["wall_us_per_token"] > 0
    layers = result["layers_us_per_token"]
    for name in ("loop", "schedule", "detokenize", "deliver", "ipc_send", "ipc_receive",
                 "http"):
        assert layers[name] > 0, (name, result)
    # Laya's threads by the names the OS shows (laya_core.logs.start_named): the worker's
    # engine and sender, the front end's supervisor (which reads the worker's messages) and
    # its event loop (the main thread) each spent CPU on the tokens.
    threads = result["threads_cpu_us_per_token"]
    for name in ("worker/laya-engine", "worker/laya-sender", "front/laya-supervisor",
                 "front/main"):
        assert threads.get(name, 0) > 0, (name, threads)
