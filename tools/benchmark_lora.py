"""What LoRA adapters cost a backend: decode throughput of one step's sequences with no
adapter, one adapter on all, half and half, and three groups (base and two adapters), in
alternating rounds, in-process (one replica, the embedded model).

    python tools/benchmark_lora.py ADAPTER [--backend torch|llamacpp] [--rounds 5]
                                           [--threads 2]

ADAPTER is an adapter of the embedded model in the backend's format: a PEFT folder for
torch, a GGUF file for llamacpp (tests/lora_adapters.py trains one and converts it); the
second adapter is the same matrices under another name, which costs what another adapter
of that rank would. torch applies each sequence's adapter to its rows; llama.cpp runs a
forward pass per adapter among a step's sequences. Eight sequences of 96 greedy tokens each (``ignore_eos``),
prefix caching off so every round prefills alike. Prints each round and, last, the ratios
to the base model's throughput of the same round and the machine's CPU, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # laya_core from the checkout
sys.path.insert(1, str(Path(__file__).resolve().parent))

from benchmark_rounds import machine  # noqa: E402

from laya_core.config import manifest as mf  # noqa: E402
from laya_core.plugins import load_registry  # noqa: E402
from laya_core.serving.deployment import Deployment  # noqa: E402
from laya_core.types import SamplingParams  # noqa: E402

QUESTIONS = ["Tell me a long story about a dragon.", "Write a poem about rain.",
             "Explain how engines work.", "Describe Paris.", "Tell me about the ocean.",
             "What is music?", "Describe a forest.", "How do planes fly?"]
MIXES: dict[str, list[str | None]] = {
    "base x8": [None] * 8,
    "one adapter x8": ["a"] * 8,
    "base 4 + adapter 4": [None] * 4 + ["a"] * 4,
    "base 3 + a 3 + b 2": [None] * 3 + ["a"] * 3 + ["b"] * 2,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("adapter", type=Path)
    p.add_argument("--backend", choices=("torch", "llamacpp"), default="torch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        second = Path(scratch) / ("b" + args.adapter.suffix)
        if args.adapter.is_dir():
            shutil.copytree(args.adapter, second)
        else:
            shutil.copyfile(args.adapter, second)
        registry = load_registry()
        manifest = mf.resolve(mf.from_dict({"models": [{
            "name": "smollm2", "backend": args.backend,
            "path": "embedded:smollm2-135m-instruct",
            "max_seq_len": 512, "max_num_seqs": 8, "prefix_caching": False,
            "options": {"n_threads": args.threads},
            "lora": {"a": str(args.adapter.resolve()), "b": str(second)}}]}), registry)
        deployment = Deployment(manifest, registry)
        deployment.start()
        try:
            if not deployment.wait_ready(300):
                print(deployment.engines[0].error, file=sys.stderr)
                return 1
            results = measure(deployment, args.rounds, args.max_tokens)
        finally:
            deployment.stop()
    ratios = {name: [round(t / b, 2) for t, b in zip(tps, results["base x8"], strict=True)]
              for name, tps in results.items()}
    print(json.dumps({"backend": args.backend, "tokens_per_s": results, "ratio_to_base": ratios,
                      "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
                      "machine": machine()}, indent=1))
    return 0


def measure(deployment: Deployment, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    engine = deployment.engines[0]
    tokenizer = engine.backend.tokenizer()
    prompts = [tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                add_special=True) for q in QUESTIONS]

    async def one(prompt: list[int], adapter: str | None) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                lora=adapter)
        return sum([len(e.token_ids) async for e in engine.submit(prompt, params)])

    def run(adapters: list[str | None]) -> float:
        async def go() -> list[int]:
            return list(await asyncio.gather(*(one(p, a) for p, a in
                                               zip(prompts, adapters, strict=True))))
        start = time.perf_counter()
        tokens = sum(asyncio.run(go()))
        return tokens / (time.perf_counter() - start)

    run(MIXES["base x8"])  # warm-up
    results: dict[str, list[float]] = {name: [] for name in MIXES}
    for r in range(rounds):
        for name, adapters in MIXES.items():
            results[name].append(round(run(adapters), 1))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in results.items()),
              flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
