"""The torch backend on the embedded model, checked against transformers' LlamaForCausalLM
loaded from the same weights (the model exported to a Hugging Face folder)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from laya_backend_torch.backend import TorchBackend
from laya_backend_torch.batch import build_batch
from laya_backend_torch.model import LlamaModel
from torch_fixtures import *  # noqa: E402, F403 - the fixtures (torch_fixtures.py)
from torch_fixtures import PROMPTS, own_pool  # noqa: E402

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import FinishReason, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# float32 logits against transformers' float32: the same operations in another order
# (fused q/k/v and gate/up matrices, SDPA over gathered blocks). Measured: 1e-4 at most.
LOGITS_BOUND = 2e-3


def start(path: str, **options: Any) -> tuple[Deployment, Engine]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "backend": "torch", "path": path, "max_seq_len": 512,
        "max_num_seqs": 4, "max_step_tokens": 128,
        "options": {"dtype": "float32", "n_threads": 1, **options}}]}), registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    assert deployment.wait_ready(120), deployment.engines[0].error
    return deployment, deployment.engines[0]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    deployment, e = start("embedded:smollm2-135m-instruct")
    yield e
    deployment.stop()


def ids_of(engine: Engine, text: str) -> list[int]:
    return engine.backend.tokenizer().encode(text, add_special=True)


def model_of(engine: Engine) -> LlamaModel:
    backend = engine.backend
    assert isinstance(backend, TorchBackend)
    return backend._model  # type: ignore[no-any-return]


def solo_logits(model: LlamaModel, ids: list[int], table: list[int]) -> torch.Tensor:
    """Every position's logits of ``ids`` prefilled alone into blocks ``table``."""
    with torch.inference_mode():
        return model.forward(build_batch([(ids, 0, table)], list(range(len(ids))), 16))


def generate(engine: Engine, ids: list[int], **params: Any) -> tuple[list[int], FinishReason]:
    async def go() -> tuple[list[int], FinishReason]:
        events = [e async for e in engine.submit(ids, SamplingParams(**params))]
        reason = events[-1].finish_reason
        assert reason is not None
        return [t for e in events for t in e.token_ids], reason

    return asyncio.run(go())


def test_logits_match_transformers(engine: Engine, hf_model: Any) -> None:
    model = model_of(engine)
    with own_pool(model):
        check_logits(engine, model, hf_model)


def check_logits(engine: Engine, model: LlamaModel, hf_model: Any) -> None:
    for prompt in PROMPTS:
        ids = ids_of(engine, prompt)
        # Blocks far into the pool, out of order: only the block table places the KV.
        ours = solo_logits(model, ids, [7, 3, 5][: -(-len(ids) // 16)])
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        diff = (ours - theirs).abs().max().item()
        assert diff < LOGITS_BOUND, f"{prompt!r}: logits differ by {diff}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_text_equals_transformers_for_32_tokens(engine: Engine, hf_model: Any) -> None:
    for prompt in PROMPTS[:2]:
        ids = ids_of(engine, prompt)
        ours, _ = generate(engine, ids, max_tokens=32, temperature=0.0, ignore_eos=True)
        assert ours == hf_greedy(hf_model, ids, 32), prompt


def hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, past end tokens as ignore_eos goes on (``generate``
    would stop at them, or with min_new_tokens mask them out). Each token is the arg-max of
    a full forward pass of all before it: no cache API in the way."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids + out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def test_a_sequence_in_a_batch_equals_its_solo_run(engine: Engine) -> None:
    """One step holding a prefill chunk from a cached prefix, another's first chunk and two
    decodes gives each sequence the logits its solo run gives."""
    model = model_of(engine)
    with own_pool(model):
        check_batch_invariance(engine, model)


def check_batch_invariance(engine: Engine, model: LlamaModel) -> None:
    texts = [ids_of(engine, p) for p in PROMPTS]
    solo = [solo_logits(model, ids, [20 + 4 * i, 21 + 4 * i, 22 + 4 * i])
            for i, ids in enumerate(texts)]
    b, a, c, d = texts  # a, the longest, continues from a cached prefix
    items = [(a[5:], 5, [40, 41, 42]),  # its first 5 positions are cached below
             (b, 0, [44, 45, 46]),
             (c[-1:], len(c) - 1, [48, 49, 50]),
             (d[-1:], len(d) - 1, [52, 53, 54])]
    with torch.inference_mode():
        model.forward(build_batch([(a[:5], 0, [40]), (c[:-1], 0, [48, 49, 50]),
                                   (d[:-1], 0, [52, 53, 54])], [0], 16))
        rows = [len(a) - 6, len(a) - 5 + len(b) - 1, len(a) - 5 + len(b),
                len(a) - 5 + len(b) + 1]
        batched = model.forward(build_batch(items, rows, 16))
    for i, logits in zip((1, 0, 2, 3), batched, strict=True):
        diff = (logits - solo[i][-1]).abs().max().item()
        assert diff < 1e-3, f"sequence {i}: {diff}"


def test_seeded_sampling_repeats_beside_other_requests(engine: Engine) -> None:
    ids = ids_of(engine, PROMPTS[1])
    params = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone, _ = generate(engine, ids, **params)

    async def crowd() -> list[list[int]]:
        async def one(p: dict[str, Any], prompt: list[int]) -> list[int]:
            return [t async for e in engine.submit(prompt, SamplingParams(**p))
                    for t in e.token_ids]

        others = [one({"max_tokens": 30, "temperature": 1.0}, ids_of(engine, q))
                  for q in PROMPTS[2:]]
        return list(await asyncio.gather(one(params, ids), *others))

    beside = asyncio.run(crowd())[0]
    assert beside == alone
    assert generate(engine, ids, **{**params, "seed": 99})[0] != alone


def test_blocks_are_given_back_and_samplers_freed(engine: Engine) -> None:
    for i in range(12):
        generate(engine, ids_of(engine, f"{PROMPTS[i % 4]} {i}"), max_tokens=3)
    assert engine.kv_used_tokens == 0
    assert not engine.backend._samplers  # type: ignore[attr-defined]


def test_a_hugging_face_folder_serves_what_the_gguf_does(engine: Engine,
                                                         hf_export_dir: Any) -> None:
    """The exported folder (safetensors, tokenizer.json, the chat template) through the same
    backend: the same model information and the same greedy tokens as the GGUF."""
    deployment, folder = start(str(hf_export_dir))
    try:
        assert folder.info is not None and engine.info is not None
        assert folder.info.eog_token_ids == engine.info.eog_token_ids
        assert folder.info.chat_template == engine.info.chat_template
        ids = ids_of(engine, PROMPTS[1])
        assert ids_of(folder, PROMPTS[1]) == ids
        assert generate(folder, ids, max_tokens=16, temperature=0.0) == \
            generate(engine, ids, max_tokens=16, temperature=0.0)
        assert "safetensors" in folder.runtime()["checkpoint"].lower() or \
            "hugging face" in folder.runtime()["checkpoint"].lower()
    finally:
        deployment.stop()
