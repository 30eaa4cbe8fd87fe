"""The ledger checked against reality: RSS growth of a process that loads the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_rss_growth_matches_the_ledger(layout: str, q4_0_model: str) -> None:
    source, options = WEIGHT_LAYOUTS[layout]
    model = {**MODEL, "options": options}
    if source == "q4_0":
        model["path"] = q4_0_model
    script = Path(__file__).with_name("rss_stages.py")
    out = subprocess.run([sys.executable, str(script), json.dumps({"models": [model]})],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    stages, plan = report["stages"], report["plan"]
    (ledger,) = plan["replicas"]
    overheads = {o["name"]: o["bytes"] for o in ledger["overheads"]}
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
