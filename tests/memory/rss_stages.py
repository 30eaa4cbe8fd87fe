"""Loads the embedded model in a fresh process and prints its RSS at each stage, as JSON.

Run by test_ledger_vs_rss.py in its own process, so nothing else in the test run inflates it.
A model with a draft model (``speculative.method = "draft"``) then loads the draft as the
engine does (laya_core/engine/draft_model.py), and fills its pool too: stages ``draft`` and
``draft_full``.
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
    fill(backend, config, tokens)
    stages["pool_full"] = rss().rss
    buffers = {k: f"{v / 2**20:.1f} MiB"
               for k, v in backend.describe()["weight_buffer_bytes"].items()}
    if config.speculative is not None and config.speculative.method == "draft":
        from laya_core.engine import draft_model

        tok = backend.tokenizer()
        draft = draft_model.load(config, type(backend),
                                 [tok.token_bytes(i) for i in range(tok.vocab_size)])
        stages["draft"] = rss().rss
        fill(draft.backend, draft_model.draft_config(config), tokens)
        stages["draft_full"] = rss().rss
    print(json.dumps({"stages": stages, "plan": plan.to_json(), "buffers": buffers}))


def fill(backend: object, config: object, tokens: list[int]) -> None:
    """Every slot fed to max_seq_len: the whole pool in use."""
    step = config.max_step_tokens  # type: ignore[attr-defined]
    length = config.max_seq_len  # type: ignore[attr-defined]
    for slot in range(config.max_num_seqs):  # type: ignore[attr-defined]
        backend.start_sequence(slot, SamplingParams(temperature=0.0))  # type: ignore[attr-defined]
        for start in range(0, length, step):
            chunk = tokens[start : min(start + step, length)]
            backend.step([StepItem(slot, chunk, start, start + len(chunk) == length)])  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
