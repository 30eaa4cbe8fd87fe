"""Loads the embedded model on the torch backend in a fresh process and prints its RSS at each
stage, and its peak RSS during the load and during the steps, as JSON.

Run by test_torch_ledger.py in its own process, so nothing else in the test run inflates it.
The stages are the ledger's lines: ``start`` (laya imported) to ``torch`` (libtorch imported
and its kernels run once, on a tiny random model of the same dtype) is the torch runtime;
``torch`` to ``weights`` the weights and the tokenizer; ``weights`` to ``allocated`` the KV
pool; ``allocated`` to ``step_peak`` one step's activations and logits, the largest of a
workload that fills the pool. A model with a draft model then loads it (``draft``) and
fills its pool (``draft_full``, ``draft_step_peak``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import attrs

from laya_core.backend import ModelConfig, StepItem
from laya_core.config import manifest as mf
from laya_core.kv.hashing import BLOCK_SIZE
from laya_core.memory import planner
from laya_core.memory.ledger import scored_tokens_per_step
from laya_core.plugins import load_registry
from laya_core.types import SamplingParams

# The widest sampling the decode step runs: penalties, top-k over the whole vocabulary, top-p
# and min-p, so the sampler's vocabulary-wide tensors are all there.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02, seed=1,
                         repetition_penalty=1.1, presence_penalty=0.2, logprobs=5)
PROMPT = "The lighthouse keeper wrote in his diary. " * 400


def rss() -> int:
    return _status("VmRSS")


def peak() -> int:
    """The highest RSS since ``reset_peak`` (VmHWM): the load's and the steps' transients."""
    return _status("VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux 4.0+: VmHWM := VmRSS


def _status(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def warm_up(config: ModelConfig) -> None:
    """Run torch's kernels once, as this replica will (dtype, quantize, threads), on a one-layer
    model with a 256-token vocabulary: what libtorch costs with nothing of the model loaded."""
    import torch
    from laya_backend_torch import options
    from laya_backend_torch.checkpoint import read_header
    from laya_backend_torch.batch import build_batch
    from laya_backend_torch.model import LlamaModel

    shape, stored = read_header(config.path)
    chosen = options.choose(config.options, stored)
    torch.set_num_threads(chosen.threads)
    tiny = attrs.evolve(shape, vocab_size=256, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    tensors = ((name, torch.randn(shape, generator=gen) * 0.02)
               for name, shape in tiny.tensor_shapes().items())
    with torch.inference_mode():
        model = LlamaModel(tiny, tensors, getattr(torch, chosen.dtype), torch.device("cpu"),
                           quantize=chosen.quantize, max_positions=64)
        model.allocate_kv(64, torch.float16)
        model.forward(build_batch([(list(range(20)), 0, [0, 1])], [18, 19], BLOCK_SIZE))
        logits = model.forward(build_batch([([5], 20, [0, 1]), ([6], 0, [2])], [0, 1],
                                           BLOCK_SIZE))
        torch.log_softmax(logits.double(), dim=-1).topk(5, dim=1)


def fill_pool(backend: Any, config: ModelConfig, tokens: list[int]) -> dict[str, int]:
    """Every slot to max_seq_len in chunks of max_step_tokens, then one decode step of every
    sequence together, then the first chunk again scoring its prompt (as many rows as a step
    may score), over what the other steps left in the heap. Returns each kind's peak RSS."""
    assert config.max_seq_len and config.max_num_seqs
    length, step = config.max_seq_len, config.max_step_tokens
    tables = [list(range(seq * length // BLOCK_SIZE, (seq + 1) * length // BLOCK_SIZE))
              for seq in range(config.max_num_seqs)]
    peaks: dict[str, int] = {}

    def run(kind: str, items: list[StepItem]) -> None:
        reset_peak()
        backend.step(items)
        peaks[kind] = max(peaks.get(kind, 0), peak())

    for seq, table in enumerate(tables):
        backend.start_sequence(seq, SAMPLED)
        for start in range(0, length - 1, step):
            end = min(start + step, length - 1)
            run("chunk", [StepItem(seq, tokens[start:end], start, False, block_table=table)])
    run("decode", [StepItem(seq, [tokens[length - 1]], length - 1, True, block_table=table)
                   for seq, table in enumerate(tables)])
    scored = tokens[1:1 + scored_tokens_per_step(step)]  # the same KV written again
    run("scored chunk", [StepItem(0, tokens[:step], 0, False, score_targets=scored,
                                  score_top=20, block_table=tables[0])])
    return peaks


def main() -> None:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict(json.loads(sys.argv[1])), registry)
    assert "torch" not in sys.modules, "laya imported torch before a torch model was asked for"
    stages = {"start": rss()}
    plan = planner.make_plan(manifest, registry)  # reads the file's header; imports torch
    config = planner.decided_manifest(manifest, plan).models[0]
    from laya_backend_torch.memory import release_freed_heap

    warm_up(config)
    release_freed_heap()  # the tiny model's pages: they are not the runtime's
    stages["torch"] = rss()
    reset_peak()
    backend = registry.backends[config.backend].obj(config)
    backend.load_weights()
    tokens = backend.tokenizer().encode(PROMPT, add_special=True)
    stages["weights"], stages["load_peak"] = rss(), peak()
    assert config.kv_cache_tokens and config.max_num_seqs
    backend.allocate_kv(num_tokens=config.kv_cache_tokens, max_num_seqs=config.max_num_seqs)
    stages["allocated"] = rss()
    step_peaks = fill_pool(backend, config, tokens)
    stages["pool_full"], stages["step_peak"] = rss(), max(step_peaks.values())
    if config.speculative is not None and config.speculative.method == "draft":
        # The draft model as the engine loads it (laya_core/engine/draft_model.py), then
        # its pool filled as the model's was.
        from laya_core.engine import draft_model

        tok = backend.tokenizer()
        draft = draft_model.load(config, type(backend),
                                 [tok.token_bytes(i) for i in range(tok.vocab_size)])
        stages["draft"] = rss()
        draft_peaks = fill_pool(draft.backend, draft_model.draft_config(config), tokens)
        stages["draft_full"], stages["draft_step_peak"] = rss(), max(draft_peaks.values())
    print(json.dumps({"stages": stages, "step_peaks": step_peaks, "plan": plan.to_json(),
                      "runtime": backend.describe()}))


if __name__ == "__main__":
    main()
