"""Loads the embedded model in a fresh process and prints its RSS at each stage, as JSON.

Run by test_ledger_vs_rss.py in its own process, so nothing else in the test run inflates it.
"""

from __future__ import annotations

import json
import sys

import psutil

from laya_core.backend import StepItem
from laya_core.config import manifest as mf
from laya_core.memory import planner
from laya_core.plugins import load_registry
from laya_core.types import SamplingParams


def main() -> None:
    rss = psutil.Process().memory_info
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict(json.loads(sys.argv[1])), registry)
    plan = planner.make_plan(manifest, registry)
    config = planner.decided_manifest(manifest, plan).models[0]
    import llama_cpp  # noqa: F401 - count the library in the baseline, as a server has it

    stages = {"start": rss().rss}
    backend = registry.backends[config.backend].obj(config)
    backend.load_weights()
    stages["weights"] = rss().rss
    backend.allocate_cache(n_ctx=config.kv_cache_tokens, max_num_seqs=config.max_num_seqs)
    stages["allocated"] = rss().rss
    tokens = backend.tokenize("The lighthouse keeper wrote in his diary. " * 400,
                              add_special=True)
    step = config.max_step_tokens
    for slot in range(config.max_num_seqs):  # fill every slot to max_seq_len: the whole pool
        backend.start_sequence(slot, SamplingParams(temperature=0.0))
        for start in range(0, config.max_seq_len, step):
            chunk = tokens[start : min(start + step, config.max_seq_len)]
            backend.step([StepItem(slot, chunk, start, start + len(chunk) == config.max_seq_len)])
    stages["pool_full"] = rss().rss
    buffers = {k: f"{v / 2**20:.1f} MiB"
               for k, v in backend.describe()["weight_buffer_bytes"].items()}
    print(json.dumps({"stages": stages, "plan": plan.to_json(), "buffers": buffers}))


if __name__ == "__main__":
    main()
