"""llama.cpp's rows, exact: with flash attention off, the build `make install` makes computes
each row of a several-row batch (a draft's check, a prompt's chunk) bit for bit as a one-row
decode computes it (plugins/backend_llamacpp/patches/exact-attention-rows.patch, beside the
Q4_1 kernel's exact rows). The embedded model (Q4_1 layers, a Q8_0 head), llama.cpp called
directly. Without the patch, rows from the fourth on differed by up to 0.69 in a logit
(docs/benchmarks.md), and these tests fail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from laya_core.builtin.model_paths import embedded_file

pytestmark = pytest.mark.model

TEXT = b"def f(x):\n    return x + 1\nclass A:\n    pass\n" * 60


class Decoder:
    """One sequence of a llama.cpp context: feed tokens at a position, read rows' logits."""

    def __init__(self, threads: int) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self.lib = llama_cpp
        self.model = Llama(embedded_file("smollm2-135m-instruct"), n_ctx=1024, n_batch=512,
                           n_threads=threads, flash_attn=False, verbose=False)
        self.ctx = self.model._ctx.ctx
        self.tokens = self.model.tokenize(TEXT)[:512]
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def feed(self, start: int, count: int) -> list[np.ndarray]:
        """Tokens ``start .. start + count`` after dropping the KV from ``start``; each
        row's logits."""
        lib, b = self.lib, self.batch
        lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), 0, start, -1)
        b.n_tokens = count
        for i in range(count):
            b.token[i], b.pos[i], b.n_seq_id[i] = self.tokens[start + i], start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        assert lib.llama_decode(self.ctx, b) == 0
        vocab = self.model.n_vocab()
        return [np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i),
                                      shape=(vocab,)).copy() for i in range(count)]

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.model.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def decoder(request: Any) -> Iterator[Decoder]:
    d = Decoder(request.param)
    yield d
    d.close()


def differences(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("at", [40, 400])  # fewer and more KV cells than a tile of 256
def test_a_check_s_rows_are_the_one_row_decodes(decoder: Decoder, at: int) -> None:
    decoder.feed(0, at)
    alone = [decoder.feed(at + i, 1)[0] for i in range(9)]
    together = decoder.feed(at, 9)
    assert [g.tobytes() == w.tobytes() for g, w in zip(together, alone, strict=True)] == \
        [True] * 9, differences(together, alone)


def test_a_prompt_s_rows_are_the_same_in_any_chunks(decoder: Decoder) -> None:
    whole = decoder.feed(0, 300)
    for cut in (1, 7, 150, 298):
        decoder.feed(0, cut)
        rest = decoder.feed(cut, 300 - cut)
        assert all(g.tobytes() == w.tobytes() for g, w in zip(rest, whole[cut:], strict=True)), \
            (cut, max(differences(rest, whole[cut:])))
    # ... and so is the KV they leave: the next token decodes alike after each.
    decoder.feed(0, 300)
    after_whole = decoder.feed(300, 1)[0]
    decoder.feed(0, 13)
    decoder.feed(13, 287)
    assert decoder.feed(300, 1)[0].tobytes() == after_whole.tobytes()
