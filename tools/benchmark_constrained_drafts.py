"""Structured output with prompt lookup: a JSON schema's output copying records from its
prompt, with and without drafts, in alternating rounds.

    python tools/benchmark_constrained_drafts.py --backend llamacpp --rounds 2 --k 8

Each round starts a replica of the embedded model with the backend's defaults, once plain
and once with ``speculative = {method = "ngram", num_speculative_tokens = K}``, in this
process (no HTTP: the engine's own speed), and sends three prompts one after another
(concurrency 1), greedy, each asking for two to four records back as a JSON array under a
schema of their fields. A warm-up pass compiles the schema first. It prints per round the
output tokens/s of each and the drafts' counts, then each round's ratio to the plain
replica. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_rounds import machine  # noqa: E402

RECORDS = [{"id": i, "name": f"customer {i} of the northern district", "city": city,
            "email": f"user{i}@example.com",
            "notes": "pays on time, prefers email, asked about the winter discount"}
           for i, city in enumerate(["Oslo", "Lyon", "Porto", "Gdansk"])]
FIELDS = {"id": {"type": "integer"}, **{k: {"type": "string"}
                                        for k in ("name", "city", "email", "notes")}}
SCHEMA = {"type": "array", "items": {"type": "object", "properties": FIELDS,
                                     "required": list(FIELDS)}}
PROMPTS = [f"<|im_start|>user\nReturn these records as a JSON array, unchanged:\n"
           f"{json.dumps(RECORDS[:k], indent=1)}<|im_end|>\n<|im_start|>assistant\n"
           for k in (2, 3, 4)]


def replica(backend: str, speculative: dict[str, Any] | None) -> tuple[Any, Any]:
    from laya_core.config import manifest as mf
    from laya_core.plugins import load_registry
    from laya_core.serving.deployment import Deployment

    registry = load_registry()
    model: dict[str, Any] = {"name": "m", "path": "embedded:smollm2-135m-instruct",
                             "backend": backend}
    if speculative:
        model["speculative"] = speculative
    deployment = Deployment(mf.resolve(mf.from_dict({"models": [model]}), registry), registry)
    deployment.start()
    if not deployment.wait_ready(300):
        raise SystemExit(f"the replica did not load: {deployment.engines[0].error}")
    return deployment, deployment.engines[0]


def tokens_per_s(engine: Any) -> tuple[int, float]:
    """Output tokens of the three prompts, one after another, and their tokens/s."""
    from laya_core.structured import formats
    from laya_core.structured.compiler import GrammarCompiler
    from laya_core.types import SamplingParams

    compiler = GrammarCompiler(engine.tokenizer, engine.info)
    spec = formats.json_schema(SCHEMA, "schema")
    params = SamplingParams(max_tokens=256, temperature=0.0)

    async def one(prompt: str) -> int:
        n = 0
        async for event in engine.submit(engine.tokenizer.encode(prompt, add_special=False),
                                         params, constraint=compiler.constraint(spec)):
            n += len(event.token_ids)
        return n

    start = time.perf_counter()
    n = sum(asyncio.run(one(p)) for p in PROMPTS)
    return n, n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="llamacpp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--out", help="write the rounds as JSON here")
    args = p.parse_args(argv)
    configs = {"plain": None,
               f"ngram{args.k}": {"method": "ngram", "num_speculative_tokens": args.k}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, speculative in configs.items():
            load = os.getloadavg()[0]
            deployment, engine = replica(args.backend, speculative)
            try:
                tokens_per_s(engine)  # warm-up: the schema's compile, the lexer's states
                n, rate = tokens_per_s(engine)
                stats = engine.speculative
                runs[name].append({"load": load, "tokens": n, "tokens_per_s": round(rate, 2),
                                   "draft_tokens": stats.num_draft_tokens,
                                   "accepted_tokens": stats.num_accepted_tokens})
                print(f"round {r + 1} {name:>8} (load {load:.2f}): {n} tokens, {rate:.1f} tok/s, "
                      f"drafted "
                      f"{stats.num_draft_tokens}, kept {stats.num_accepted_tokens}", flush=True)
            finally:
                deployment.stop()
    ratios = {name: [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                     for a, b in zip(rs, runs["plain"], strict=True)]
              for name, rs in runs.items()}
    for name, rs in ratios.items():
        print(f"{name:>8}: ratio to plain, per round {rs}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "machine": machine(), "runs": runs,
                       "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
