"""llama.cpp's tokenizer used from several threads while the engine decodes.

The engine runs with one llama.cpp thread (on its own engine thread), and four threads
tokenize and detokenize meanwhile; everything must come out as it does single-threaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from laya_backend_llamacpp.tokenizer import LlamaTokenizer

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.models.tokenizer import TokenizerClosedError
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

TEXTS = [
    "The lighthouse keeper wrote in his diary. " * 200,
    "<|im_start|>user\nWie heißt die Hauptstadt von Österreich?<|im_end|>\n" * 50,
    "def f(x):\n    return {'a': [x, x ** 2]}  # ünïcödé, 東京, emoji 🚀\n" * 100,
    "".join(chr(c) for c in range(32, 2000)) * 3,
]


def started_deployment(max_seq_len: int, max_num_seqs: int) -> Deployment:
    """The embedded model in-process, one thread (no OpenMP team left on this thread)."""
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "smollm2", "path": "embedded:smollm2-135m-instruct",
        "max_seq_len": max_seq_len, "max_num_seqs": max_num_seqs,
        "options": {"n_threads": 1}}]}), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(60), d.engines[0].error
    return d


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = started_deployment(512, 4)
    yield d
    d.stop()


def _decode_in_background(engine: Engine, started: threading.Event) -> threading.Thread:
    """Four long greedy generations on an event loop of their own."""

    async def go() -> None:
        assert engine.tokenizer is not None
        prompt = engine.tokenizer.encode("Tell me a long story.", add_special=True)
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        streams = [engine.submit(prompt, params) for _ in range(4)]
        await streams[0].wait_admitted()
        started.set()
        for stream in streams:
            async for _ in stream:
                pass

    thread = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
    thread.start()
    return thread


def test_tokenizing_from_threads_while_decoding_matches_one_thread(
        deployment: Deployment) -> None:
    engine = deployment.engines[0]
    tok = deployment.clients[0].tokenizer()
    assert isinstance(tok, LlamaTokenizer)
    cases = [(t, special, parse) for t in TEXTS for special in (True, False)
             for parse in (True, False)]
    expected = [tok.encode(t, add_special=s, parse_special=p) for t, s, p in cases]
    ids = range(tok.vocab_size)
    pieces = [tok.token_bytes(i) for i in ids]
    started = threading.Event()
    decoding = _decode_in_background(engine, started)
    assert started.wait(30)

    def work(worker: int) -> tuple[list[list[int]], list[bytes]]:
        # A tokenizer of its own on the same vocabulary: an empty piece cache, so every
        # token's bytes come from llama_token_to_piece while the engine decodes.
        fresh = LlamaTokenizer(tok._ll, tok._vocab, tok.vocab_size, tok.special_tokens)
        got = [fresh.encode(t, add_special=s, parse_special=p)
               for _ in range(3) for t, s, p in cases]
        return got, [fresh.token_bytes(i) for i in ids[worker::4]]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    still_decoding = engine.num_running > 0
    for worker, (got, worker_pieces) in enumerate(results):
        assert got == expected * 3
        assert worker_pieces == pieces[worker::4]
    assert still_decoding, "the generations ended before the tokenizing did"
    decoding.join(120)
    assert not decoding.is_alive()


def test_the_tokenizer_refuses_once_the_model_is_unloaded() -> None:
    d = started_deployment(128, 1)
    tok = d.clients[0].tokenizer()
    assert tok.encode("Hello", add_special=False)
    d.stop()
    with pytest.raises(TokenizerClosedError):
        tok.encode("Hello", add_special=False)
    with pytest.raises(TokenizerClosedError):
        tok.token_bytes(tok.vocab_size - 1)
