"""The ledger checked against reality: RSS growth of a process that loads the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MODEL = {"name": "smollm2", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 512,
         "max_num_seqs": 4, "max_step_tokens": 256}
WEIGHTS_TOLERANCE = 0.15  # weights pages are mapped from the file; vocabulary tables are estimated
KV_TOLERANCE = 0.05  # the KV pool is one buffer, cleared (so resident) when allocated


# Whichever buffers the weights go to: the embedded Q4_1 file mapped as it is; a Q4_0 copy
# that llama.cpp repacks (CPU_REPACK on AVX2 and NEON; left unpacked where auto avoids AMX);
# the same copy mapped with repacking off.
WEIGHT_LAYOUTS = {"q4_1-auto": ("embedded", {}), "q4_0-auto": ("q4_0", {}),
                  "q4_0-no-repack": ("q4_0", {"repack": False})}


def rss_report(model: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """rss_stages.py's report for one model, run in a process of its own; its replica's
    ledger; and that ledger's overhead lines by name."""
    script = Path(__file__).with_name("rss_stages.py")
    out = subprocess.run([sys.executable, str(script), json.dumps({"models": [model]})],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    (ledger,) = report["plan"]["replicas"]
    return report, ledger, {o["name"]: o["bytes"] for o in ledger["overheads"]}


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_rss_growth_matches_the_ledger(layout: str, q4_0_model: str) -> None:
    source, options = WEIGHT_LAYOUTS[layout]
    model = {**MODEL, "options": options}
    if source == "q4_0":
        model["path"] = q4_0_model
    report, ledger, overheads = rss_report(model)
    stages, plan = report["stages"], report["plan"]
    weights_growth = stages["weights"] - stages["start"]
    weights_ledger = ledger["weights_bytes"] + overheads["vocabulary"]
    kv_growth = stages["allocated"] - stages["weights"]
    kv_ledger = ledger["kv_pool_bytes"] + overheads["logits buffer"]
    in_use_growth = stages["pool_full"] - stages["weights"]
    mib = 2**20
    print(f"\n{layout}: weights in {report['buffers']}; weights: RSS +{weights_growth / mib:.1f} MiB, ledger {weights_ledger / mib:.1f} MiB;"
          f" KV pool allocated: RSS +{kv_growth / mib:.1f} MiB, ledger {kv_ledger / mib:.1f} MiB;"
          f" pool full: +{in_use_growth / mib:.1f} MiB, ledger with compute buffer "
          f"{(kv_ledger + overheads['compute buffer']) / mib:.1f} MiB; process "
          f"{stages['pool_full'] / mib:.1f} MiB, plan {plan['total_bytes'] / mib:.1f} MiB")
    assert abs(weights_growth - weights_ledger) <= WEIGHTS_TOLERANCE * weights_ledger
    assert abs(kv_growth - kv_ledger) <= KV_TOLERANCE * kv_ledger
    # Filling the pool also touches the compute buffer, which the ledger counts on its own.
    assert in_use_growth <= (kv_ledger + overheads["compute buffer"]) * (1 + KV_TOLERANCE)
    assert stages["pool_full"] <= plan["total_bytes"]


def test_a_draft_models_lines_match_its_rss() -> None:
    """The embedded model drafting for its float16 copy (tests/draft_models.py): loading the
    draft as the engine does grows RSS by its weights, vocabulary, KV pool and logits lines,
    and filling its pool stays within those and its compute buffer; the whole process
    stays within the plan."""
    from draft_models import f16_copy

    model = {**MODEL, "path": str(f16_copy()), "speculative": {
        "method": "draft", "model": "embedded:smollm2-135m-instruct"}}
    report, _, lines = rss_report(model)
    stages, plan = report["stages"], report["plan"]
    loaded = sum(lines[f"draft model {name}"] for name in ("weights", "KV", "vocabulary",
                                                           "logits buffer"))
    full = loaded + lines["draft model compute buffer"]
    growth = stages["draft"] - stages["pool_full"]
    full_growth = stages["draft_full"] - stages["pool_full"]
    mib = 2**20
    print(f"\ndraft model: loaded +{growth / mib:.1f} MiB, lines {loaded / mib:.1f} MiB; pool "
          f"full +{full_growth / mib:.1f} MiB, with the compute buffer {full / mib:.1f} MiB;"
          f" process {stages['draft_full'] / mib:.1f} MiB, plan {plan['total_bytes'] / mib:.1f}")
    assert abs(growth - loaded) <= WEIGHTS_TOLERANCE * loaded
    assert full_growth <= full * (1 + KV_TOLERANCE)
    assert stages["draft_full"] <= plan["total_bytes"]
