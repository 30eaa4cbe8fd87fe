"""One computation of pool sizes: `laya plan` and a loaded engine decide the same ones."""

from __future__ import annotations

import attrs
import pytest
from toy_backend import ToyBackend

from laya_core.backend import ModelInfo
from laya_core.builtin.model_paths import embedded_file
from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.kv.policies import PagedKVCache
from laya_core.memory import planner
from laya_core.models.files import read_shape
from laya_core.plugins import load_registry

MODEL = embedded_file("smollm2-135m-instruct")


class ShapedToy(ToyBackend):
    """The toy model with the embedded model's trained context, as its header says."""

    def load_weights(self) -> ModelInfo:
        info = super().load_weights()
        return attrs.evolve(info, n_ctx_train=read_shape(MODEL).n_ctx_train)

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        super().allocate_kv(num_tokens=num_tokens, max_num_seqs=max_num_seqs)
        self.allocated = (num_tokens, max_num_seqs)


@pytest.mark.parametrize("sizes", [
    {}, {"max_num_seqs": 3}, {"max_seq_len": 1024},
    {"kv_cache_tokens": 16384}, {"kv_cache_tokens": 10000, "max_seq_len": 2048},
    {"kv_cache_tokens": 20000, "max_num_seqs": 2}, {"max_num_seqs": 200, "max_seq_len": 64},
])
def test_the_engine_decides_the_sizes_the_plan_decided(sizes: dict) -> None:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"memory": {"budget": "64GiB"}, "models": [
        {"name": "m", "path": MODEL, "backend": "llamacpp", **sizes}]}),
        registry, need_backends=False)
    (planned,) = planner.make_plan(manifest, registry).replicas
    (config,) = manifest.models
    backend = ShapedToy(config)
    engine = Engine(config, backend, FcfsScheduler, PagedKVCache)
    engine.start()
    try:
        assert engine.wait_ready(5), engine.error
        assert engine.sizes == planned.config
        assert backend.allocated == (planned.pool_tokens, planned.config.max_num_seqs)
        assert engine.max_seq_len == planned.max_seq_len
        assert engine.scheduler is not None
        assert engine.scheduler.config.max_step_tokens == planned.config.max_step_tokens
    finally:
        engine.stop()
