"""Stage "logits": Laya's torch backend on the GPU against transformers, on the 1B model.

    python tools/gpu_check/compare_logits.py

The reference is transformers' LlamaForCausalLM on the same device and weights. Three
prompts (one block of 16 tokens, several, a long prefill) go through both, every position's
logits compared; then greedy output of a real engine (scheduler, paged KV, the long prompt
prefilled in chunks of ``STEP_TOKENS``, sampling on the device) against transformers' greedy
``generate`` (end tokens masked, as Laya's ``ignore_eos``).

- float32 (TF32 off, float32 KV): Laya's logits within ``FP32_BOUND`` of transformers' at
  every position, the same arg-max at 99% of them at least, and the same greedy tokens.
- bfloat16 (bfloat16 KV): no exact match is expected, so transformers' own bfloat16 error is
  the yardstick. Against float32 transformers, Laya's largest difference may be at most
  twice transformers' bfloat16 one (+ ``BF16_SLACK``), and its arg-max agreement at most
  5 points below transformers' bfloat16's. Its greedy tokens are reported, not judged.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import common

PROMPT_TOKENS = (12, 100, 400)
GREEDY_TOKENS = 32
STEP_TOKENS = 128  # the 400-token prompt is prefilled in 4 chunks
# float32 against float32: the same operations in another order (fused q/k/v, gathered
# blocks, float32 attention). tests/backend_torch holds the embedded model (30 layers, 576
# wide) to 2e-3 on a CPU; a random model 2,048 wide is given a little more room.
FP32_BOUND = 5e-3
FP32_TOP1 = 0.99
BF16_SLACK = 0.02
BF16_TOP1_DROP = 0.05


def prompts(tokenizer: Any) -> list[list[int]]:
    """Prompts of ``PROMPT_TOKENS`` tokens, cut from different places of the documents."""
    text = "\n\n".join(common.sample_texts())
    ids = tokenizer.encode(text, add_special=False)
    bos = [tokenizer.info.bos_id]
    return [bos + ids[2000 * i:2000 * i + n - 1] for i, n in enumerate(PROMPT_TOKENS)]


def start_laya(folder: Path, dtype: str, **options: Any) -> tuple[Any, Any]:
    """A deployment of the model on this process's threads, and its engine."""
    from laya_core.config import manifest as mf
    from laya_core.plugins import load_registry
    from laya_core.serving.deployment import Deployment

    registry = load_registry()
    kv = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    options |= {"device": common.device(), "dtype": dtype}
    if common.dry_run():
        options["n_threads"] = 2
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "gpu-check-1b", "backend": "torch", "path": str(folder),
        "max_seq_len": 512, "max_num_seqs": 4, "max_step_tokens": STEP_TOKENS,
        "kv_cache_dtype": kv, "options": options}]}), registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    if not deployment.wait_ready(300):
        error = deployment.engines[0].error
        deployment.stop()
        raise common.StageFailed(f"the torch backend did not load {folder.name} ({options}): "
                                 f"{error}")
    return deployment, deployment.engines[0]


def direct_logits(engine: Any) -> tuple[list[Any], list[list[int]]]:
    """Every position's logits of each prompt, each prefilled alone in one forward pass of
    the engine's model; and the prompts."""
    import torch
    from laya_backend_torch.batch import build_batch

    asked = prompts(engine.backend.tokenizer())
    model = engine.backend._model
    pool = model.kv_pool
    # A pool of its own for the direct passes, so the engine's blocks stay as its KV
    # manager knows them (the engine is idle meanwhile).
    model.allocate_kv(-(-max(PROMPT_TOKENS) // 16) * 16, pool.dtype)
    logits = []
    try:
        with torch.inference_mode():
            for ids in asked:
                table = list(range(-(-len(ids) // 16)))
                batch = build_batch([(ids, 0, table)], list(range(len(ids))), 16)
                logits.append(model.forward(batch.to(model.device)).float().cpu())
    finally:
        model.kv_pool = pool
    return logits, asked


def laya_outputs(folder: Path, dtype: str) -> tuple[list[Any], list[list[int]], Any]:
    """(every position's logits of each prompt, greedy tokens of each, the prompts)."""
    from laya_core.types import SamplingParams

    deployment, engine = start_laya(folder, dtype)
    try:
        logits, asked = direct_logits(engine)

        async def greedy(ids: list[int]) -> list[int]:
            params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                    ignore_eos=True)
            return [t async for e in engine.submit(ids, params) for t in e.token_ids]

        tokens = [asyncio.run(greedy(ids)) for ids in asked]
        return logits, tokens, asked
    finally:
        deployment.stop()


def int8_probe(folder: Path, reference: list[Any]) -> dict[str, Any]:
    """``quantize = "int8"``, which the options allow on CUDA: whether it runs there
    (torch._weight_int8pack_mm, a CUDA kernel only in some torch versions) and how far its
    arg-max is from float32's. Reported, not judged."""
    try:
        deployment, engine = start_laya(folder, "bfloat16", quantize="int8")
    except common.StageFailed as e:
        return {"ok": False, "error": str(e)[:300]}
    try:
        start = time.monotonic()
        logits, _ = direct_logits(engine)
        return {"ok": True, "forward_s": round(time.monotonic() - start, 2),
                "top1_vs_fp32": compare(logits, reference)["top1_agreement"]}
    except Exception as e:  # noqa: BLE001 - the finding is the error itself
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        deployment.stop()


def transformers_outputs(folder: Path, dtype: str, asked: list[list[int]]
                         ) -> tuple[list[Any], list[list[int]]]:
    """The same as ``laya_outputs``, from transformers' LlamaForCausalLM."""
    import torch

    dev = common.device()
    model = common.transformers_model(folder, dtype)
    try:
        with torch.inference_mode():
            logits = [model(torch.tensor([ids], device=dev)).logits[0].float().cpu()
                      for ids in asked]
            tokens = []
            for ids in asked:  # min_new_tokens: end tokens masked, as ignore_eos has them
                out = model.generate(torch.tensor([ids], device=dev), do_sample=False,
                                     max_new_tokens=GREEDY_TOKENS,
                                     min_new_tokens=GREEDY_TOKENS, pad_token_id=0)
                tokens.append(out[0, len(ids):].tolist())
        return logits, tokens
    finally:
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


def compare(got: list[Any], ref: list[Any]) -> dict[str, float]:
    """Largest |difference| over every position and vocabulary entry, the same relative to
    the reference's largest |logit|, and the share of positions with the same arg-max."""
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))
    scale = max(float(r.abs().max()) for r in ref)
    same = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref, strict=True))
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale,
            "top1_agreement": same / sum(len(r) for r in ref)}


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def judge(numbers: dict[str, Any]) -> list[str]:
    """The checks of the module docstring that failed, each said with its numbers."""
    f32, b16, hf16 = numbers["fp32"], numbers["bf16_vs_fp32"], numbers["hf_bf16_vs_fp32"]
    problems = []
    if f32["max_abs_diff"] > FP32_BOUND:
        problems.append(f"float32 logits differ by {f32['max_abs_diff']:.2e} > {FP32_BOUND}")
    if f32["top1_agreement"] < FP32_TOP1:
        problems.append(f"float32 arg-max agrees at {f32['top1_agreement']:.1%} of positions")
    if numbers["fp32_greedy_same"] != [GREEDY_TOKENS] * len(PROMPT_TOKENS):
        problems.append(f"float32 greedy tokens agree for {numbers['fp32_greedy_same']} of "
                        f"{GREEDY_TOKENS}")
    bound = 2 * hf16["max_abs_diff"] + BF16_SLACK
    if b16["max_abs_diff"] > bound:
        problems.append(f"bfloat16 logits are {b16['max_abs_diff']:.3f} from float32, over "
                        f"{bound:.3f} (twice transformers' bfloat16 error + {BF16_SLACK})")
    if b16["top1_agreement"] < hf16["top1_agreement"] - BF16_TOP1_DROP:
        problems.append(f"bfloat16 arg-max agrees at {b16['top1_agreement']:.1%}, "
                        f"transformers' bfloat16 at {hf16['top1_agreement']:.1%}")
    return problems


def main() -> None:
    with common.stage("logits") as numbers:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32
        torch.backends.cudnn.allow_tf32 = False
        folder = common.model_dir("1b")
        numbers["device"] = common.device()
        numbers["bounds"] = {"fp32_max_abs_diff": FP32_BOUND, "fp32_top1": FP32_TOP1,
                             "bf16": f"<= 2 x transformers' bf16 error + {BF16_SLACK}; "
                                     f"top-1 within {BF16_TOP1_DROP:.0%} of it"}
        # Each comparison recorded as soon as it is made: a later failure keeps them.
        laya32, greedy32, asked = laya_outputs(folder, "float32")
        numbers["prompt_tokens"] = [len(ids) for ids in asked]
        hf32, hf_greedy32 = transformers_outputs(folder, "float32", asked)
        numbers["fp32"] = compare(laya32, hf32)
        numbers["fp32_greedy_same"] = [same_prefix(a, b) for a, b in
                                       zip(greedy32, hf_greedy32, strict=True)]
        laya16, greedy16, _ = laya_outputs(folder, "bfloat16")
        hf16, hf_greedy16 = transformers_outputs(folder, "bfloat16", asked)
        numbers["bf16_vs_fp32"] = compare(laya16, hf32)
        numbers["hf_bf16_vs_fp32"] = compare(hf16, hf32)
        numbers["bf16_vs_hf_bf16"] = compare(laya16, hf16)
        numbers["bf16_greedy_same"] = [same_prefix(a, b) for a, b in
                                       zip(greedy16, hf_greedy16, strict=True)]
        numbers["int8"] = int8_probe(folder, hf32)
        if problems := judge(numbers):
            raise common.StageFailed("; ".join(problems))


if __name__ == "__main__":
    main()
