"""A backend driven by hand, one step at a time, as the engine would: feed a slot's tokens
from a position, sample, feed the sample back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.types import Sample


@contextlib.contextmanager
def llamacpp_backend(**options: object) -> Iterator[Any]:
    """The llama.cpp backend of the embedded model, loaded, four slots of 512 tokens each
    (a 2,048-token context), with ``options``; closed afterwards."""
    from laya_backend_llamacpp.backend import LlamaCppBackend

    config = ModelConfig(name="m", backend="llamacpp",
                         path=embedded_file("smollm2-135m-instruct"), max_seq_len=512,
                         max_num_seqs=4, options=options)
    b = LlamaCppBackend(config)
    b.load_weights()
    b.allocate_cache(n_ctx=2048, max_num_seqs=4)
    try:
        yield b
    finally:
        b.close()


def generate(backend: Any, slot: int, fed: list[int], start: int, n: int = 8) -> list[Sample]:
    """``n`` samples of ``slot``: ``fed`` at positions ``start``.., then each sample in turn."""
    out: list[Sample] = []
    for _ in range(n):
        sample = backend.step([StepItem(slot, fed, start, True)])[0].sample
        assert sample is not None
        out.append(sample)
        start, fed = start + len(fed), [sample.token_id]
    return out
