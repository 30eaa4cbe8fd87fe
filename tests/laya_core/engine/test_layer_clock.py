"""The engine's layer clock (laya_core/engine/layer_clock.py) on the toy backend: each layer
of the engine thread is counted, grows with the tokens, and adds up to no more than the
time the run took."""

from __future__ import annotations

import asyncio
import time

from toy_backend import started_engine

from laya_core.engine.engine import Engine
from laya_core.engine.layer_clock import LAYERS, LayerClock, merged, now_ns
from laya_core.types import SamplingParams

ENGINE_LAYERS = ("loop", "schedule", "prefill", "backend", "detokenize", "deliver")


def generate(e: Engine, count: int, max_tokens: int) -> None:
    async def one(i: int) -> None:
        stream = e.submit(list(b"abcdef"[: i + 2]), SamplingParams(max_tokens=max_tokens,
                                                                   ignore_eos=True))
        async for _ in stream:
            pass

    async def all_of_them() -> None:
        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(all_of_them())


def test_a_clock_sums_each_layer_apart() -> None:
    clock = LayerClock()
    assert clock.seconds() == {}  # a layer that never ran is not reported
    start = now_ns()
    clock.add(LAYERS.index("http"), start - 2_000_000)
    assert clock.calls[LAYERS.index("http")] == 1
    assert 0.002 <= clock.seconds()["http"]
    assert merged({"http": 1.0}, {"http": 0.5, "backend": 2.0}) == {"http": 1.5, "backend": 2.0}


def test_engine_layers_grow_with_tokens_within_the_wall_time() -> None:
    e = started_engine(max_seq_len=64, max_num_seqs=4, options={"step_delay_s": 0.001})
    try:
        start = time.perf_counter()
        generate(e, 3, 10)
        wall_s = time.perf_counter() - start
        first, steps = e.clock.seconds(), e.clock.calls[LAYERS.index("backend")]
        assert e.generated_tokens == 30
        assert set(first) == set(ENGINE_LAYERS), first  # no worker process, no HTTP here
        assert all(v >= 0 for v in first.values())
        assert sum(first.values()) <= wall_s  # one thread's layers never overlap
        assert first["backend"] >= 0.001 * steps  # the toy's sleep is in the model's layer
        generate(e, 1, 5)
        again = e.clock.seconds()
        for layer in ("backend", "detokenize", "deliver", "schedule"):
            assert again[layer] > first[layer], layer
    finally:
        e.stop()
