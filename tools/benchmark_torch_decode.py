"""Decode speed of the torch backend against transformers ``generate`` on the same weights.

    python tools/benchmark_torch_decode.py --rounds 3 --threads 1 \\
        --config float32 --config 'bfloat16:{"dtype": "bfloat16", "quantize": "none"}' \\
        --config 'int8:{"dtype": "bfloat16", "quantize": "int8"}' \\
        --config 'int4:{"dtype": "bfloat16", "quantize": "int4"}'

The embedded model is exported to a Hugging Face folder (``laya-export-hf``) and loaded by
transformers' LlamaForCausalLM in float32: that is the reference, its single-stream greedy
``generate`` tokens/s. Each Laya configuration (``NAME[:OPTIONS_JSON]``, the torch backend's
``[models.options]``) runs in this process through a real engine: single-stream decode
tokens/s (from the first token to the last, so prefill is left out, as it is for the
reference, whose time is taken beside a 1-token generate of the same prompt) and aggregate
tokens/s of ``--concurrency`` requests at once. Rounds alternate every configuration and
the reference, so the ratios compare runs of the same minutes (these machines drift 10-15%
from minute to minute). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "<|im_start|>user\nTell me a long story about a lighthouse keeper.<|im_end|>\n" \
         "<|im_start|>assistant\n"


def export(out: Path) -> None:
    from laya_core.builtin.model_paths import embedded_file

    subprocess.run([sys.executable, "-m", "laya_backend_torch.export",
                    embedded_file("smollm2-135m-instruct"), str(out)], check=True)


def reference_tokens_per_s(model: Any, ids: list[int], n: int) -> float:
    import torch

    prompt = torch.tensor([ids])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t
    return (n - 1) / (total - prefill)


def start_engine(options: dict[str, Any], threads: int, concurrency: int) -> Any:
    from laya_core.config import manifest as mf
    from laya_core.plugins import load_registry
    from laya_core.serving.deployment import Deployment

    registry = load_registry()
    m = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "backend": "torch", "path": "embedded:smollm2-135m-instruct",
        "max_seq_len": 1024, "max_num_seqs": max(concurrency, 1),
        "options": {"n_threads": threads, **options}}]}), registry)
    deployment = Deployment(m, registry)
    deployment.start()
    if not deployment.wait_ready(300):
        raise RuntimeError(deployment.engines[0].error)
    return deployment


async def _one(engine: Any, ids: list[int], n: int) -> tuple[float, float]:
    """(seconds from the first token to the last, tokens after the first)."""
    from laya_core.types import SamplingParams

    first = last = 0.0
    count = 0
    async for event in engine.submit(ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                         ignore_eos=True)):
        if event.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(event.token_ids)
    return last - first, count - 1


def laya_rates(options: dict[str, Any], ids: list[int], n: int, threads: int,
               concurrency: int) -> tuple[float, float]:
    deployment = start_engine(options, threads, concurrency)
    engine = deployment.engines[0]
    try:
        asyncio.run(_one(engine, ids, 8))  # warm-up
        took, tokens = asyncio.run(_one(engine, ids, n))
        single = tokens / took

        async def crowd() -> float:
            t = time.perf_counter()
            runs = await asyncio.gather(*(_one(engine, ids + [i + 10], n)
                                          for i in range(concurrency)))
            return sum(tok + 1 for _, tok in runs) / (time.perf_counter() - t)

        return single, asyncio.run(crowd())
    finally:
        deployment.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", default=[], metavar="NAME[:OPTIONS_JSON]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, help="write the rounds and medians as JSON here")
    args = p.parse_args(argv)
    args.config = args.config or ["float32"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from laya_backend_torch.tokenizer import load_tokenizer
    from transformers import LlamaForCausalLM

    configs = {}
    for spec in args.config:
        name, _, opts = spec.partition(":")
        # A bare dtype name: that dtype, dense (quantize "auto" would keep the file's int4).
        configs[name] = json.loads(opts) if opts else {"dtype": name, "quantize": "none"}
    with tempfile.TemporaryDirectory() as tmp:
        export(Path(tmp) / "hf")
        reference = LlamaForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
        ids = load_tokenizer(str(Path(tmp) / "hf")).encode(PROMPT, add_special=True)
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    refs: list[float] = []
    for r in range(args.rounds):
        torch.set_num_threads(args.threads)
        refs.append(reference_tokens_per_s(reference, ids, args.tokens))
        print(f"round {r + 1}: transformers generate float32 {refs[-1]:.1f} tokens/s",
              flush=True)
        for name, options in configs.items():
            single, aggregate = laya_rates(options, ids, args.tokens, args.threads,
                                           args.concurrency)
            rows[name].append((single, aggregate))
            print(f"round {r + 1}: {name}: single {single:.1f} tokens/s "
                  f"({single / refs[-1]:.2f}x transformers), c={args.concurrency} "
                  f"{aggregate:.1f} tokens/s ({aggregate / single:.2f}x single)", flush=True)
    summary = {"threads": args.threads, "tokens": args.tokens,
               "transformers_generate": statistics.median(refs), "configs": {}}
    print(f"\nmedians over {args.rounds} rounds, {args.threads} thread(s):")
    print(f"  transformers generate (float32): {summary['transformers_generate']:.1f} tokens/s")
    for name, runs in rows.items():
        ratios = [s / ref for (s, _), ref in zip(runs, refs, strict=True)]
        single = statistics.median(s for s, _ in runs)
        aggregate = statistics.median(a for _, a in runs)
        summary["configs"][name] = {"options": configs[name], "single": single,
                                    "aggregate": aggregate, "ratio_to_transformers": ratios}
        print(f"  {name}: single {single:.1f} tokens/s, ratio to transformers per round "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; c={args.concurrency} "
              f"{aggregate:.1f} tokens/s ({aggregate / single:.2f}x single)")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rounds": rows,
                                        "transformers": refs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
