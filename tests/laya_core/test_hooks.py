"""Each hook of laya_core.hookspecs, implemented by a plugin written here, selected by a
manifest and seen at work serving one request (spec/hooks.md names these tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from toy_backend import ToyBackend

from laya_core.config import manifest as mf
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.hookspecs import hookimpl
from laya_core.http import create_app
from laya_core.kv.policies import PagedKVCache
from laya_core.plugins import load_registry
from laya_core.routing.router import PythonRouter
from laya_core.serving.deployment import Deployment


class CountingRouter(PythonRouter):
    routed = 0

    def route(self, model: str, session: str | None = None, prefix: Any = ()) -> int:
        CountingRouter.routed += 1
        return super().route(model, session, prefix)


class CountingScheduler(FcfsScheduler):
    steps = 0

    def schedule(self):  # type: ignore[no-untyped-def]
        CountingScheduler.steps += 1
        return super().schedule()


class CountingCache(PagedKVCache):
    admitted = 0

    def admit(self, seq):  # type: ignore[no-untyped-def]
        CountingCache.admitted += 1
        super().admit(seq)


class Plugin:
    """One plugin implementing every hook."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights

    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("toy", ToyBackend)

    @hookimpl
    def register_routers(self, register):  # type: ignore[no-untyped-def]
        register("counting", CountingRouter)

    @hookimpl
    def register_schedulers(self, register):  # type: ignore[no-untyped-def]
        register("counting", CountingScheduler)

    @hookimpl
    def register_cache_policies(self, register):  # type: ignore[no-untyped-def]
        register("counting-paged", CountingCache)

    @hookimpl
    def resolve_model_path(self, path: str) -> str | None:
        return str(self.weights) if path == "toys:tiny" else None


class Declines:
    """A resolver that recognises nothing: firstresult passes over its None."""

    @hookimpl
    def resolve_model_path(self, path: str) -> str | None:
        return None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Deployment, httpx.Response]]:
    weights = tmp_path / "toy.bin"
    weights.write_bytes(b"")
    registry = load_registry([Declines(), Plugin(weights)])
    manifest = mf.resolve(mf.from_dict({
        "router": {"impl": "counting"},
        "models": [{"name": "toy", "backend": "toy", "path": "toys:tiny",
                    "scheduler": "counting", "cache_policy": "counting-paged",
                    "max_seq_len": 64}]}), registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    assert deployment.wait_ready(10), deployment.engines[0].error

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/completions", json={
                "model": "toy", "prompt": "hook", "max_tokens": 4})

    try:
        response = asyncio.run(ask())
        yield deployment, response
    finally:
        deployment.stop()


def test_register_backends(served: tuple[Deployment, httpx.Response]) -> None:
    deployment, response = served
    assert isinstance(deployment.engines[0].backend, ToyBackend)
    assert response.json()["choices"][0]["text"] == "hook"  # the toy repeats its prompt


def test_register_routers(served: tuple[Deployment, httpx.Response]) -> None:
    deployment, _ = served
    assert isinstance(deployment.router, CountingRouter) and CountingRouter.routed >= 1


def test_register_schedulers(served: tuple[Deployment, httpx.Response]) -> None:
    deployment, _ = served
    assert isinstance(deployment.engines[0].scheduler, CountingScheduler)
    assert CountingScheduler.steps >= 1


def test_register_cache_policies(served: tuple[Deployment, httpx.Response]) -> None:
    deployment, _ = served
    assert type(deployment.engines[0].scheduler.kv) is CountingCache  # type: ignore[union-attr]
    assert CountingCache.admitted >= 1


def test_resolve_model_path(served: tuple[Deployment, httpx.Response]) -> None:
    deployment, _ = served
    registry = load_registry([Declines(), Plugin(Path("/models/toy.bin"))])
    assert registry.resolve_model_path("toys:tiny") == "/models/toy.bin"
    assert registry.resolve_model_path("elsewhere:tiny") is None  # nobody's: None
    assert registry.resolve_model_path("embedded:smollm2-135m-instruct").endswith(".gguf")
    assert deployment.models["toy"].path.endswith("toy.bin")  # the manifest's toys:tiny


def test_a_path_no_plugin_resolves_says_so() -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [{"name": "m", "path": "nobody:tiny"}]}),
                   load_registry([Declines()]))
    assert info.value.key == "models[0].path"
    assert "no installed plugin resolves nobody: paths" in str(info.value)
