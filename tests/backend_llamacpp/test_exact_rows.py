"""llama.cpp's rows, exact: with flash attention off, the build `make install` makes computes
each row of a several-row batch (a draft's check, a prompt's chunk) bit for bit as a one-row
decode computes it (plugins/backend_llamacpp/patches/exact-attention-rows.patch, beside the
Q4_1 kernel's exact rows). The embedded model (Q4_1 layers, a Q8_0 head), llama.cpp called
directly through tools/llamacpp_rows.py's ``Rows``. Without the patch, rows from the fourth
on differed by up to 0.69 in a logit (docs/benchmarks.md), and these tests fail. The other
patches keep it: f16-dot-rows.patch computes several of attention's outputs at once, each as
ggml_vec_dot_f16 sums it, and kv-cells-pad.patch attends over the cells in use rounded to 64
rather than 256."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from laya_core.builtin.model_paths import embedded_file
from tools.llamacpp_rows import Rows

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def rows(request: Any) -> Iterator[Rows]:
    r = Rows(embedded_file("smollm2-135m-instruct"), flash_attn=False, threads=request.param)
    yield r
    r.lib.llama_batch_free(r.batch)
    r.model.close()


def feed(rows: Rows, start: int, count: int) -> list[np.ndarray]:
    """Tokens ``start .. start + count`` after the KV from ``start`` is dropped; each row's
    logits."""
    rows.decode(start, count, every_row=True)
    return [rows.logits(i) for i in range(count)]


def differences(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)]


# 40 and 400: fewer and more KV cells than a tile of 256. 472: the one-row decodes of rows
# 472-479 attend over 512 cells, as the check does, because kv-cells-pad.patch rounds the
# cells in use to 64. Rounded to 32 they attended over 480, the cells from 448 on fell in
# ggml_vec_dot_f16's scalar tail rather than its SIMD loop, and rows 2-9 differed from the
# check's by 0.56-0.85 in a logit (measured with a build that rounds to 32).
@pytest.mark.parametrize("at", [40, 400, 472])
def test_a_check_s_rows_are_the_one_row_decodes(rows: Rows, at: int) -> None:
    feed(rows, 0, at)
    alone = [feed(rows, at + i, 1)[0] for i in range(9)]
    together = feed(rows, at, 9)
    assert [g.tobytes() == w.tobytes() for g, w in zip(together, alone, strict=True)] == \
        [True] * 9, differences(together, alone)


def test_a_prompt_s_rows_are_the_same_in_any_chunks(rows: Rows) -> None:
    whole = feed(rows, 0, 300)
    for cut in (1, 7, 150, 298):
        feed(rows, 0, cut)
        rest = feed(rows, cut, 300 - cut)
        assert all(g.tobytes() == w.tobytes() for g, w in zip(rest, whole[cut:], strict=True)), \
            (cut, max(differences(rest, whole[cut:])))
    # ... and so is the KV they leave: the next token decodes alike after each.
    feed(rows, 0, 300)
    after_whole = feed(rows, 300, 1)[0]
    feed(rows, 0, 13)
    feed(rows, 13, 287)
    assert feed(rows, 300, 1)[0].tobytes() == after_whole.tobytes()
