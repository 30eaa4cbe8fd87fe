"""Stage "throughput": decode tokens/s of ``laya serve`` against transformers' ``generate``
on the 8B model, one sequence and 64 at once, 128 new tokens each, greedy.

    python tools/gpu_check/throughput.py

transformers: LlamaForCausalLM in bfloat16 on the GPU (SDPA attention, its default dynamic
cache, no torch.compile, whose warm-up alone would take minutes), one batch of 32-token
prompts. ``decode`` is (new tokens - 1) per row over the time a 128-token generate takes
beyond a 1-token one; ``output`` is all new tokens over the whole generate.
Laya: the same model served in bfloat16 with a bfloat16 KV cache, streamed completions with
``ignore_eos`` (load.py); ``decode`` at concurrency 1 likewise: (new tokens - 1) over the
time a 128-token stream takes beyond a 1-token one (medians of sequential streams);
``output`` every token of the level over its wall time. Each side is warmed up first. After
the measurements the OpenAI battery (battery.py) runs against the served model.

The stage passes when both sides measured and the battery passed; the numbers are reported,
not judged.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import battery
import common
import load
import memory_probe
from server import LayaServer

NEW_TOKENS = 16 if common.dry_run() else 128
PROMPT_TOKENS = 32
BATCHES = (1, 16) if common.dry_run() else (1, 64)
SERIAL_REQUESTS = 2 if common.dry_run() else 3  # sequential streams at concurrency 1
MAX_SEQ_LEN = 512


def generate_seconds(model: Any, ids: Any, new_tokens: int) -> float:
    import torch

    eos = model.generation_config.eos_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=eos[0] if isinstance(eos, list) else eos)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def transformers_rates() -> dict[str, Any]:
    import torch

    dev = common.device()
    start = time.monotonic()
    model = common.transformers_model(common.model_dir("8b"), "bfloat16")
    out: dict[str, Any] = {"load_s": round(time.monotonic() - start, 1),
                           "attention": model.config._attn_implementation}
    try:
        torch.manual_seed(0)
        # Ids of trained tokens (below the fillers), as a real prompt's would be.
        prompts = torch.randint(0, 1000, (max(BATCHES), PROMPT_TOKENS), device=dev)
        generate_seconds(model, prompts[:1], 4)  # kernels chosen, caches warm
        for batch in BATCHES:
            ids = prompts[:batch]
            generate_seconds(model, ids, 4)
            one = generate_seconds(model, ids, 1)
            full = generate_seconds(model, ids, NEW_TOKENS)
            out[f"c{batch}"] = {
                "decode_tokens_per_s": round((NEW_TOKENS - 1) / (full - one), 1),
                "output_tokens_per_s": round(batch * NEW_TOKENS / full, 1),
                "aggregate_decode_tokens_per_s": round(batch * (NEW_TOKENS - 1) / (full - one),
                                                       1)}
            common.log(f"transformers batch {batch}: {out[f'c{batch}']}")
        return out
    finally:
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()


def laya_model() -> dict[str, Any]:
    options: dict[str, Any] = {"device": common.device(), "dtype": "bfloat16"}
    if common.dry_run():
        options["n_threads"] = 1
    return {"name": "gpu-check-8b", "backend": "torch", "path": str(common.model_dir("8b")),
            "max_seq_len": MAX_SEQ_LEN, "max_num_seqs": max(BATCHES),
            "max_step_tokens": max(512, max(BATCHES) * PROMPT_TOKENS * 2),
            "kv_cache_dtype": "bf16", "options": options}


def prompts() -> list[str]:
    """Texts of about 32 tokens each, cut from the documents at different places."""
    words = " ".join(common.sample_texts()).split()
    return [" ".join(words[400 * i:400 * i + 20]) for i in range(max(BATCHES))]


def laya_rates(out: dict[str, Any]) -> None:
    """Laya's numbers, put in ``out`` as they come (a failure keeps the earlier ones)."""
    budget = None if common.dry_run() else "100GiB"  # the VM's free RAM grows as it is used
    with LayaServer("throughput", laya_model(), budget=budget) as server:
        texts, name = prompts(), "gpu-check-8b"
        out["ready_s"] = round(server.ready_s, 1)
        out["runtime"] = server.status()["replicas"][0].get("runtime")
        load.run_level(server.url, name, texts, concurrency=1, requests=1, max_tokens=8)
        one = load.run_level(server.url, name, texts, concurrency=1,
                             requests=SERIAL_REQUESTS, max_tokens=1)
        out["c1"] = c1 = load.run_level(server.url, name, texts, concurrency=1,
                                        requests=SERIAL_REQUESTS, max_tokens=NEW_TOKENS)
        beyond = c1["e2e_p50_s"] - one["e2e_p50_s"]
        c1["decode_tokens_per_s"] = round((NEW_TOKENS - 1) / beyond, 1) if beyond > 0 else None
        common.log(f"laya c=1: {out['c1']}")
        top = max(BATCHES)
        load.run_level(server.url, name, texts, concurrency=top, requests=top, max_tokens=4)
        out[f"c{top}"] = load.run_level(server.url, name, texts, concurrency=top,
                                        requests=top, max_tokens=NEW_TOKENS)
        common.log(f"laya c={top}: {out[f'c{top}']}")
        # The 1-minute load average: exllamav2's compile may run beside (at nice 10).
        out["loadavg_1m"] = round(os.getloadavg()[0], 1)
        out["memory"] = memory_probe.replica_memory(server.manifest, server.status())
        out["battery"] = battery.run(server.url, name, MAX_SEQ_LEN)


def ratios(laya: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Laya's rate over transformers' at each level: decode at 1, output at the top."""
    top = max(BATCHES)
    pairs = {"c1_decode": (laya["c1"]["decode_tokens_per_s"], hf["c1"]["decode_tokens_per_s"]),
             f"c{top}_output": (laya[f"c{top}"]["output_tokens_per_s"],
                                hf[f"c{top}"]["output_tokens_per_s"])}
    return {k: round(a / b, 2) if a and b else None for k, (a, b) in pairs.items()}


def main() -> None:
    with common.stage("throughput") as numbers:
        from laya_core.plugins import load_registry

        numbers["new_tokens"], numbers["prompt_tokens"] = NEW_TOKENS, PROMPT_TOKENS
        numbers["router"] = load_registry().router_name(None)  # what laya serve routes with
        problems = []
        try:
            numbers["transformers"] = transformers_rates()
        except Exception as e:  # noqa: BLE001 - Laya is still measured
            problems.append(f"transformers: {type(e).__name__}: {str(e)[:200]}")
        numbers["laya"] = laya = {}
        laya_rates(laya)
        if "transformers" in numbers:
            numbers["laya_over_transformers"] = ratios(laya, numbers["transformers"])
        if laya["battery"]["failed"]:
            problems.append(battery.summary(laya["battery"]))
        if problems:
            raise common.StageFailed("; ".join(problems))


if __name__ == "__main__":
    main()
