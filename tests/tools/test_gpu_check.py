"""tools/gpu_check.sh's CPU dry run: the GPU check's plumbing (tree install, model making,
logits against transformers, laya serve under load, the OpenAI battery, the record) on tiny
models, so that the script a GPU session runs once keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"
ON_A_GPU = ("router_build", "gpu_tests", "exl2_build", "exl2")


def test_the_cpu_dry_run_passes_every_stage_it_can_run(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    env.pop("GPU_CHECK_ONLY", None)
    run = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run"], env=env, capture_output=True,
                         text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in record["stages"]}
    assert statuses == {"environment": "PASS", "models": "PASS", "logits": "PASS",
                        "throughput": "PASS"} | dict.fromkeys(ON_A_GPU, "SKIPPED"), statuses
    stages = {s["name"]: s for s in record["stages"]}
    assert stages["logits"]["numbers"]["fp32_greedy_same"] == [32, 32, 32]
    laya = stages["throughput"]["numbers"]["laya"]
    assert laya["battery"]["failed"] == {} and len(laya["battery"]["passed"]) == 8
    assert laya["c1"]["output_tokens_per_s"] > 0 and laya["c16"]["output_tokens_per_s"] > 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary in run.stdout and "PASS    throughput" in summary
    for log in ("stages.log", "servers.log"):
        assert (tmp_path / "out" / log).stat().st_size > 0
    assert not list((tmp_path / "work" / "pids").iterdir())  # nothing left running
