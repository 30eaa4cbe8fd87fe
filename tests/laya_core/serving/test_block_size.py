"""A backend's own block size (``Backend.block_size``): the engine's KV pool, prefix reuse,
the router's prefix hashes and /live all count in it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from toy_backend import ToyBackend, follow_up_conversation, shared_prefix_workload

from laya_core.backend import ModelConfig
from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.hookspecs import hookimpl
from laya_core.http import create_app
from laya_core.kv.hashing import BLOCK_SIZE
from laya_core.kv.policies import PagedKVCache
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams


class SmallBlocks(ToyBackend):
    name = "toy8"
    block_size = 8


class LargeBlocks(ToyBackend):
    name = "toy32"
    block_size = 32


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register(SmallBlocks.name, SmallBlocks)
        register(LargeBlocks.name, LargeBlocks)


def engine_of(backend: type[ToyBackend], **config: object) -> Engine:
    cfg = ModelConfig(name="toy", backend=backend.name, path="-", **config)  # type: ignore[arg-type]
    engine = Engine(cfg, backend(cfg), FcfsScheduler, PagedKVCache)
    engine.start()
    assert engine.wait_ready(5)
    return engine


def cached_tokens(engine: Engine, prompt: bytes) -> int:
    async def go() -> int:
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=1))
        usage = [e.usage async for e in stream if e.usage is not None]
        return usage[-1].cached_tokens

    return asyncio.run(go())


@pytest.mark.parametrize("backend", [SmallBlocks, LargeBlocks])
def test_the_pool_and_prefix_reuse_count_in_the_backends_blocks(
        backend: type[ToyBackend]) -> None:
    assert backend.block_size != BLOCK_SIZE
    engine = engine_of(backend, max_seq_len=256, max_num_seqs=4, kv_cache_tokens=1024)
    assert engine.scheduler.kv.block_size == backend.block_size
    prompt = bytes(range(97, 97 + 26)) * 3  # 78 tokens
    assert cached_tokens(engine, prompt) == 0
    # Whole blocks of the backend's size, leaving its last prompt chunk to compute.
    assert cached_tokens(engine, prompt) == (len(prompt) - backend.min_last_prompt_chunk) \
        // backend.block_size * backend.block_size
    engine.stop()
    # Every output exact while blocks are shared, reused and evicted (the toy repeats its
    # prompt, reading its history through the block tables only).
    shared_prefix_workload(engine_of(backend, max_seq_len=128, max_num_seqs=4,
                                     kv_cache_tokens=640, max_step_tokens=64))
    follow_up_conversation(engine_of(backend, max_seq_len=256, max_num_seqs=2))


def deployment(tmp_path: Path, backend: type[ToyBackend]) -> Deployment:
    weights = tmp_path / "toy.bin"
    weights.write_bytes(b"")
    registry = load_registry([Plugin()])
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "m", "backend": backend.name, "path": str(weights), "replicas": 2,
        "max_seq_len": 64, "max_num_seqs": 1, "routing": "prefix"}]}), registry)
    return Deployment(manifest, registry)


def test_the_router_hashes_prompts_in_the_backends_blocks(tmp_path: Path) -> None:
    d = deployment(tmp_path, SmallBlocks)
    assert d.block_sizes == {"m": 8}
    d.start()
    assert d.wait_ready(10)

    async def go() -> dict:
        transport = httpx.ASGITransport(app=create_app(d))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            # 12 tokens each, the first 8 shared: one hashed block of 8, none of 16. The
            # first goes to the least loaded replica; the second follows its prefix there.
            for prompt in ("abcdefgh1234", "abcdefgh5678"):
                r = await c.post("/v1/completions",
                                 json={"model": "m", "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
            return (await c.get("/live")).json()

    live = asyncio.run(go())
    generated = [s.generated_tokens for _, s in d.snapshot().replicas]
    d.stop()
    assert sorted(generated) == [0, 4], generated  # both on one replica
    (model,) = live["models"] if isinstance(live["models"], list) else live["models"].values()
    assert {r["kv"]["block_tokens"] for r in model["replicas"]} == {8}
    assert all(r["kv"]["blocks_total"] * 8 >= r["kv"]["capacity_tokens"]
               for r in model["replicas"])
