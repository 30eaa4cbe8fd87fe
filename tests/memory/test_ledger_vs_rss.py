"""The ledger checked against reality: RSS growth of a process that loads the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MODEL = {"name": "smollm2", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 512,
         "max_num_seqs": 4, "max_step_tokens": 256}
WEIGHTS_TOLERANCE = 0.15  # weights pages are mapped from the file; vocabulary tables are estimated
KV_TOLERANCE = 0.05  # the KV pool is one buffer, cleared (so resident) when allocated


def test_rss_growth_matches_the_ledger() -> None:
    script = Path(__file__).with_name("rss_stages.py")
    out = subprocess.run([sys.executable, str(script), json.dumps({"models": [MODEL]})],
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
    print(f"\nweights: RSS +{weights_growth / mib:.1f} MiB, ledger {weights_ledger / mib:.1f} MiB;"
          f" KV pool allocated: RSS +{kv_growth / mib:.1f} MiB, ledger {kv_ledger / mib:.1f} MiB;"
          f" pool full: +{in_use_growth / mib:.1f} MiB, ledger with compute buffer "
          f"{(kv_ledger + overheads['compute buffer']) / mib:.1f} MiB; process "
          f"{stages['pool_full'] / mib:.1f} MiB, plan {plan['total_bytes'] / mib:.1f} MiB")
    assert abs(weights_growth - weights_ledger) <= WEIGHTS_TOLERANCE * weights_ledger
    assert abs(kv_growth - kv_ledger) <= KV_TOLERANCE * kv_ledger
    # Filling the pool also touches the compute buffer, which the ledger counts on its own.
    assert in_use_growth <= (kv_ledger + overheads["compute buffer"]) * (1 + KV_TOLERANCE)
    assert stages["pool_full"] <= plan["total_bytes"]
