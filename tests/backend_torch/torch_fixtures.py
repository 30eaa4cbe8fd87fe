"""Fixtures of the torch backend's tests, star-imported by the modules that use them: the
embedded model as a Hugging Face checkpoint (exported with ``laya-export-hf``, loaded by
transformers as the reference), and one torch thread on the test's thread
(``pytestmark = pytest.mark.usefixtures("one_torch_thread")``).

Not a conftest.py: the integration tests import the top-level one as ``conftest``, and a
second conftest.py here would take that name when both folders are collected."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from laya_core.builtin.model_paths import embedded_file

__all__ = ["hf_export_dir", "hf_model", "one_torch_thread", "own_pool", "pack_words"]

# Prompts the torch tests compare logits on: prose, a chat turn, code and digits.
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 5, 8, 13, 21,",
]


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """transformers runs on the test's thread with one torch thread. OpenMP's thread count
    is per calling thread (the engine sets its own), and two threads beside another busy
    process ran twenty times slower than one (measured here: 137 s against 7 s for the
    greedy comparison)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from laya_backend_torch.export import main as export_main

    out = tmp_path_factory.mktemp("hf") / "smollm2"
    assert export_main([embedded_file("smollm2-135m-instruct"), str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def hf_model(hf_export_dir: Path) -> Any:
    """transformers' LlamaForCausalLM, float32, from the exported folder."""
    import torch
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(hf_export_dir,
                                                         dtype=torch.float32).eval()


@contextlib.contextmanager
def own_pool(model: Any) -> Iterator[None]:
    """A KV pool of its own for a model's direct forward passes, so that an engine's cached
    blocks stay as its KV manager knows them (the engine is idle between tests)."""
    import torch

    pool = model.kv_pool
    model.allocate_kv(64 * 16, torch.float32)
    try:
        yield
    finally:
        model.kv_pool = pool


def pack_words(values: Any, bits: int, dim: int, order: list[int] | None = None) -> Any:
    """Integer values -> int32 words as GPTQ and AWQ store them: ``32 // bits`` consecutive
    entries of ``dim`` in each word, entry k of a run in nibble k (or in nibble
    ``order.index(k)``: AWQ's 0, 2, 4, 6, 1, 3, 5, 7). Written from the formats'
    descriptions, apart from the backend's unpacking."""
    import torch

    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., order]
    words = sum(v[..., k] << (bits * k) for k in range(per_word))
    words = torch.where(words >= 2**31, words - 2**32, words)  # as int32 stores them
    return words.to(torch.int32).movedim(-1, dim)
