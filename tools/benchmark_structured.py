"""What structured output costs: constrained streams against plain ones, and compile time.

    python tools/benchmark_structured.py --rounds 3 --concurrency 1,8 [--backend llamacpp]

Starts one server of the embedded model (``max_num_seqs = 16``) and, in alternating rounds,
streams the same prompts plain and under a JSON schema (an array of at least 12 records, so
that both kinds run to ``max_tokens``), at each concurrency. It prints per round and level
the output tokens/s of each kind and their ratio, then the medians.

Then, on the same server, the TTFT the first compile adds: requests at concurrency 1 that
each send a schema never seen before (a property name carries the request's number, so the
cache misses) against requests that repeat one schema (a cache hit), alternating; and in
this process, with llama.cpp's tokenizer of the same file, the compile times themselves:
llguidance's vocabulary (once per replica) and each schema (once per distinct schema).
``--out FILE.json`` writes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_rounds import laya_server  # noqa: E402
from benchmark_serving import (  # noqa: E402
    PROMPT_SETS,
    RequestResult,
    run_request,
    summarize,
)

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "member": {"type": "boolean"}},
    "required": ["name", "city", "age", "member"], "additionalProperties": False}
RECORDS = {"type": "array", "items": RECORD, "minItems": 12}


def body(prompt: str, max_tokens: int, seed: int, schema: Any | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "smollm2", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.7, "seed": seed, "stream": True,
        "stream_options": {"include_usage": True}}
    if schema is not None:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "records", "schema": schema}}
    else:
        out["ignore_eos"] = True  # as long as the constrained ones, which run to max_tokens
    return out


async def level(url: str, concurrency: int, requests: int, max_tokens: int,
                schema: Any | None) -> dict[str, Any]:
    prompts = PROMPT_SETS["mixed"]
    results = [RequestResult(i, i % len(prompts)) for i in range(requests)]
    pending = iter(results)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        async def worker() -> None:
            for r in pending:
                await run_request(client, f"{url}/v1/chat/completions",
                                  body(prompts[r.prompt_index], max_tokens, r.index, schema),
                                  r, 300)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize(concurrency, results, time.perf_counter() - start)


async def first_compile_ttft(url: str, pairs: int) -> dict[str, Any]:
    """TTFT of requests with a new schema each, against ones repeating a cached schema."""
    fresh, cached = [], []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(pairs):
            for kind, out in (("fresh", fresh), ("cached", cached)):
                schema = json.loads(json.dumps(RECORDS).replace(
                    '"member"', f'"member_{i}"' if kind == "fresh" else '"member"'))
                r = RequestResult(i, 0)
                await run_request(client, f"{url}/v1/chat/completions",
                                  body("List some people.", 4, i, schema), r, 300)
                assert r.ok and r.ttft_s is not None, r.detail
                out.append(r.ttft_s * 1000)
    return {"pairs": pairs, "ttft_ms_new_schema_median": round(statistics.median(fresh), 2),
            "ttft_ms_cached_schema_median": round(statistics.median(cached), 2),
            "added_ms_median": round(statistics.median(
                f - c for f, c in zip(fresh, cached, strict=True)), 2)}


def compile_times(model_path: str) -> dict[str, Any]:
    """llguidance's vocabulary build and schema compiles, with llama.cpp's tokenizer."""
    from laya_backend_llamacpp.tokenizer import LlamaTokenizer  # noqa: F401 - plugin present

    from laya_core.config import manifest as mf
    from laya_core.plugins import load_registry
    from laya_core.serving.deployment import Deployment
    from laya_core.structured import formats
    from laya_core.structured.compiler import GrammarCompiler
    from laya_core.structured.tools import Tool, ToolUse, call_grammar

    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": model_path, "max_seq_len": 256, "max_num_seqs": 1,
        "options": {"n_threads": 1}}]}), registry)
    d = Deployment(manifest, registry)
    d.start()
    try:
        assert d.wait_ready(120), d.engines[0].error
        engine = d.engines[0]
        assert engine.tokenizer is not None and engine.info is not None
        compiler = GrammarCompiler(engine.tokenizer, engine.info)
        t0 = time.perf_counter()
        compiler._vocabulary()
        vocab_s = time.perf_counter() - t0
        specs = {
            "record": formats.json_schema(RECORD, "x"),
            "records_array": formats.json_schema(RECORDS, "x"),
            "json_object": formats.json_schema({"type": "object"}, "x"),
            "tools_auto_2": call_grammar(ToolUse((Tool("get_weather", None, RECORD),
                                                  Tool("now", None, {})), "auto")),
        }
        times = {}
        for name, spec in specs.items():
            t0 = time.perf_counter()
            compiler.constraint(spec)(())  # compile, and the first mask (compiling is lazy)
            times[name] = round((time.perf_counter() - t0) * 1000, 2)
        t0 = time.perf_counter()
        for _ in range(100):
            compiler.constraint(specs["records_array"])
        hit_us = (time.perf_counter() - t0) / 100 * 1e6
        return {"vocabulary_build_ms": round(vocab_s * 1000, 1),
                "compile_and_first_mask_ms": times, "cache_hit_us": round(hit_us, 1)}
    finally:
        d.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="requests per level and kind")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--backend", default="llamacpp")
    p.add_argument("--options", default="{}", help="[models.options] as JSON")
    p.add_argument("--ttft-pairs", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    options = {**json.loads(args.options), "backend": args.backend}
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = laya_server(f"laya:{json.dumps(options)}", Path(tmp))
        proc = server.start(Path(tmp) / "server.log")
        try:
            for n in range(args.rounds):
                for c in levels:
                    order = [None, RECORDS] if n % 2 == 0 else [RECORDS, None]
                    got = {("schema" if s else "plain"): asyncio.run(
                        level(server.url, c, args.requests, args.max_tokens, s)) for s in order}
                    ratio = got["schema"]["output_tokens_per_s"] / \
                        got["plain"]["output_tokens_per_s"]
                    rounds.append({"round": n, "concurrency": c, "ratio": round(ratio, 3),
                                   **{k: v["output_tokens_per_s"] for k, v in got.items()},
                                   "finish": {k: v["finish_reasons"] for k, v in got.items()}})
                    print(json.dumps(rounds[-1]), flush=True)
            ttft = asyncio.run(first_compile_ttft(server.url, args.ttft_pairs))
            print(json.dumps({"first_compile": ttft}), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    from benchmark_rounds import embedded_model

    compiles = compile_times(embedded_model())
    print(json.dumps({"compile": compiles}), flush=True)
    summary = {c: {"median_ratio": statistics.median(r["ratio"] for r in rounds
                                                     if r["concurrency"] == c),
                   "plain_tok_s": statistics.median(r["plain"] for r in rounds
                                                    if r["concurrency"] == c),
                   "schema_tok_s": statistics.median(r["schema"] for r in rounds
                                                     if r["concurrency"] == c)}
               for c in levels}
    print(json.dumps({"summary": summary}))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds,
                                              "first_compile": ttft, "compile": compiles,
                                              "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
