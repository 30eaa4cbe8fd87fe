"""The plan's compute buffer against the one llama.cpp allocates (its own log line), with
flash attention off (the default) and on, in streams and in one shared buffer: never less,
and not much more."""

from __future__ import annotations

import re

import pytest

from laya_core.backend import ModelConfig
from laya_core.builtin.model_paths import embedded_file
from laya_core.models.files import read_shape

pytestmark = pytest.mark.model
MIB = 2**20


@pytest.mark.parametrize(("flash_attn", "unified", "n_ctx", "seqs", "step"), [
    (False, False, 8192, 4, 512),   # the default layout: a stream per slot
    (False, True, 8192, 4, 512),    # one buffer: the scores span the whole pool
    (False, True, 4096, 4, 256),
    ("auto", False, 8192, 4, 512),
])
def test_the_planned_compute_buffer_holds_llamacpps(flash_attn: object, unified: bool,
                                                    n_ctx: int, seqs: int, step: int) -> None:
    from laya_backend_llamacpp.backend import LlamaCppBackend
    from laya_backend_llamacpp.llama_log import LLAMA_LOG

    path = embedded_file("smollm2-135m-instruct")
    config = ModelConfig(name="m", backend="llamacpp", path=path, max_seq_len=n_ctx // seqs,
                         max_num_seqs=seqs, max_step_tokens=step, kv_cache_tokens=n_ctx,
                         options={"flash_attn": flash_attn, "kv_unified": unified,
                                  "n_threads": 1})
    profile = LlamaCppBackend.memory_profile(config, read_shape(path))
    (planned,) = (o.bytes for o in profile.overheads if o.name == "compute buffer")
    b = LlamaCppBackend(config)
    b.load_weights()
    try:
        with LLAMA_LOG.capture() as lines:
            b.allocate_cache(n_ctx=n_ctx, max_num_seqs=seqs)
    finally:
        b.close()
    (found,) = [float(m.group(1)) * MIB for line in lines
                if (m := re.search(r"CPU compute buffer size = +([\d.]+) MiB", line))]
    assert found <= planned <= found + 16 * MIB, (found / MIB, planned / MIB)
