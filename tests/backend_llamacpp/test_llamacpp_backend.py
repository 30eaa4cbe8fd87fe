"""The llama.cpp backend on the embedded model, driven through a real engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp
import pytest

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.chat_template import ChatTemplate
from laya_core.serving.deployment import Deployment
from laya_core.types import FinishReason, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct",
        "max_seq_len": 512, "max_num_seqs": 4}]}), registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    assert deployment.wait_ready(60), deployment.engines[0].error
    yield deployment.engines[0]
    deployment.stop()


def generate(engine: Engine, prompt: str, **params: object) -> tuple[str, list[int], FinishReason]:
    async def go() -> tuple[str, list[int], FinishReason]:
        ids = engine.backend.tokenize(prompt, add_special=True)
        events = [e async for e in engine.submit(ids, SamplingParams(**params))]  # type: ignore[arg-type]
        assert events[-1].finish_reason is not None
        return ("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                events[-1].finish_reason)

    return asyncio.run(go())


def test_model_info(engine: Engine) -> None:
    info = engine.info
    assert info is not None
    assert info.n_ctx_train == 8192 and info.vocab_size == 49152
    assert info.eog_token_ids == {0, 2, 4}
    assert info.chat_template and "im_start" in info.chat_template
    assert engine.max_seq_len == 512


def reference_completion(path: str, runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                         **request: Any) -> dict[str, Any]:
    """llama-cpp-python's own ``Llama`` completing ``request`` the way the backend runs: the
    same weight buffers (its constructor has no such argument, and on an AMX CPU its default
    segfaults) and the same thread count (llama.cpp's flash attention splits its work by
    thread). It runs on a thread of its own, as an engine does: the OpenMP team a thread's
    decodes start lives as long as that thread, and one left on pytest's main thread would
    slow every later engine of the session."""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        p = defaults()
        p.use_extra_bufts = runtime["repack"]
        return p

    def complete() -> None:
        threads = runtime["n_threads"]
        reference = llama_cpp.Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                                    verbose=False)
        try:
            out.append(reference.create_completion(**request))
        finally:
            reference.close()

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params)
    out: list[Any] = []
    worker = threading.Thread(target=complete)
    worker.start()
    worker.join()
    assert out, "the reference completion failed; see the thread's traceback above"
    return out[0]


def test_greedy_equals_llama_cpp_pythons_own_completion(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    text, tokens, _ = generate(engine, PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = reference_completion(engine.config.path, engine.backend.describe(), monkeypatch,
                                    prompt=PROMPT, max_tokens=24, temperature=0.0)
    assert text == expected["choices"][0]["text"]  # type: ignore[index]
    assert len(tokens) == 24


def test_multibyte_output_is_never_split(engine: Engine) -> None:
    text, tokens, _ = generate(engine, "Translate to Chinese: good morning, my friend. 早上好",
                               max_tokens=40, temperature=0.0)
    assert "\ufffd" not in text
    whole = b"".join(engine.backend.token_bytes(t) for t in tokens).decode("utf-8", "ignore")
    assert text == whole[: len(text)]


def test_seeded_sampling_repeats_and_seeds_differ(engine: Engine) -> None:
    params = {"max_tokens": 16, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.05}
    first = generate(engine, "Once upon a time", seed=11, **params)[0]
    assert generate(engine, "Once upon a time", seed=11, **params)[0] == first
    assert len({generate(engine, "Once upon a time", seed=s, **params)[0]
                for s in (1, 2, 3, 4)}) > 1


def test_eos_stops_and_max_tokens_limits(engine: Engine) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    info = engine.info
    assert info is not None
    chat = ChatTemplate(info.chat_template, info.bos_token, info.eos_token).render(messages)
    text, tokens, reason = generate(engine, chat, max_tokens=200, temperature=0.0)
    assert reason is FinishReason.STOP and tokens[-1] in info.eog_token_ids
    assert "<|im_end|>" not in text
    _, tokens, reason = generate(engine, chat, max_tokens=3, temperature=0.0)
    assert reason is FinishReason.LENGTH and len(tokens) == 3
    assert engine.kv_usage == 0.0
