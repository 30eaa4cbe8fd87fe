"""Plugins load by family, and a plugin defined right here can be selected by a manifest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from toy_backend import ToyBackend

from laya_core.config import manifest as mf
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.hookspecs import hookimpl
from laya_core.http import create_app
from laya_core.plugins import PluginError, collect, load_registry
from laya_core.serving.deployment import Deployment


class LifoScheduler(FcfsScheduler):
    """Admits the newest waiting sequence first."""

    def schedule(self):  # type: ignore[no-untyped-def]
        self.waiting.reverse()
        try:
            return super().schedule()
        finally:
            self.waiting.reverse()


class InTestPlugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("toy", ToyBackend)

    @hookimpl
    def register_schedulers(self, register):  # type: ignore[no-untyped-def]
        register("lifo", LifoScheduler)


def test_builtin_and_entry_point_plugins_are_listed_with_their_source() -> None:
    registry = load_registry()
    assert registry.schedulers["fcfs"].source.startswith("builtin")
    assert registry.cache_policies["paged"].source.startswith("builtin")
    assert registry.routers["python"].source.startswith("builtin")
    assert registry.backends["llamacpp"].source.startswith("laya-backend-llamacpp")


def test_registering_a_name_twice_leaves_the_second_plugin_out() -> None:
    class Clash:
        @hookimpl
        def register_schedulers(self, register):  # type: ignore[no-untyped-def]
            register("lifo", LifoScheduler)
            register("fcfs", LifoScheduler)

    registry = load_registry([Clash()])
    (failure,) = registry.failures
    assert failure.hook == "register_schedulers"
    assert "'fcfs' is registered twice: by builtin" in failure.error
    assert registry.schedulers["fcfs"].obj is FcfsScheduler
    assert "lifo" not in registry.schedulers  # nothing of a failed registration is kept
    with pytest.raises(PluginError, match="'fcfs' is registered twice"):
        collect(registry.plugin_manager, "scheduler")  # without a list to record it in


def test_a_misspelt_hook_is_caught() -> None:
    class Typo:
        @hookimpl
        def register_backend(self, register):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(Exception, match="unknown hook"):
        load_registry([Typo()])


@pytest.fixture
def toy_deployment(tmp_path: Path):  # type: ignore[no-untyped-def]
    registry = load_registry([InTestPlugin()])
    weights = tmp_path / "toy.bin"
    weights.write_bytes(b"")
    manifest = mf.resolve(mf.from_dict({"models": [
        {"name": "toy", "backend": "toy", "scheduler": "lifo", "path": str(weights),
         "max_seq_len": 64, "max_num_seqs": 2, "max_step_tokens": 8}]}), registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    assert deployment.wait_ready(10)
    yield deployment
    deployment.stop()


def test_manifest_selects_in_test_plugins_end_to_end(toy_deployment: Deployment) -> None:
    engine = toy_deployment.engines[0]
    assert isinstance(engine.backend, ToyBackend)
    assert isinstance(engine.scheduler, LifoScheduler)

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(toy_deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            bodies = [{"model": "toy", "prompt": "héllo wörld", "max_tokens": 13},
                      {"model": "toy", "prompt": "abc", "max_tokens": 40, "stop": ["ca"]},
                      {"model": "toy", "prompt": "xy\x00", "max_tokens": 9}]
            return await asyncio.gather(*(client.post("/v1/completions", json=b)
                                          for b in bodies))

    long, stopped, ended = asyncio.run(go())
    # 13 byte-tokens of the repeated prompt; the split "é" and "ö" arrive whole.
    assert long.json()["choices"][0]["text"] == "héllo wörld"
    assert long.json()["choices"][0]["finish_reason"] == "length"
    assert long.json()["usage"] == {"prompt_tokens": 13, "completion_tokens": 13,
                                    "total_tokens": 26,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
    assert stopped.json()["choices"][0]["text"] == "ab"
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    assert ended.json()["choices"][0]["text"] == "xy"
    assert ended.json()["choices"][0]["finish_reason"] == "stop"
    assert "prefill;dur=" in long.headers["server-timing"]
    # Prompts of 13 tokens went through in chunks of the 8-token step budget.
    assert max(sum(len(i.tokens) for i in step) for step in engine.backend.steps) == 8
    assert engine.kv_usage == 0.0 and engine.num_running == 0


def test_hooks_are_called_through_pluggy_so_wrappers_see_each_call() -> None:
    """A hook wrapper (a tracing or policy plugin) wraps every plugin's registration."""
    seen: list[str] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def register_backends(self, register):  # type: ignore[no-untyped-def]
            result = yield
            seen.append(register.__name__)
            return result

    registry = load_registry(extra_plugins=[Wrapper(), InTestPlugin()])
    assert "toy" in registry.backends and "llamacpp" in registry.backends
    assert registry.backends["toy"].source.startswith("registered in code")
    # Once per registering plugin (the built-in ones, the entry points, InTestPlugin):
    # pluggy ran the wrapper around each call.
    assert len(seen) == len(registry.plugin_manager.hook.register_backends.get_hookimpls()) - 1


def test_each_backend_declares_and_prices_its_kv_dtypes() -> None:
    from laya_core.kv.dtypes import kv_dtype_problems

    registry = load_registry()
    for entry in registry.backends.values():
        assert kv_dtype_problems(entry.obj.kv_cache_dtypes) == [], entry.name
    # llama.cpp's are ggml's, each one its loader can hand llama.cpp.
    from laya_backend_llamacpp.memory import GGML_TYPE

    llamacpp = registry.backends["llamacpp"].obj.kv_cache_dtypes
    assert set(llamacpp) == set(GGML_TYPE) == {"f32", "f16", "bf16", "q8_0", "q4_0"}
    assert llamacpp["q8_0"] == (32, 34) and llamacpp["q4_0"] == (32, 18)
    assert set(registry.backends["torch"].obj.kv_cache_dtypes) == {"f32", "f16", "bf16"}
    assert kv_dtype_problems({"q4": (32, 0)}) and kv_dtype_problems({})


def test_the_cache_policy_follows_the_backends_kv_layout(tmp_path: Path) -> None:
    from laya_core.backend import ModelConfig
    from laya_core.engine.engine import Engine
    from laya_core.kv.policies import PagedKVCache

    registry = load_registry([InTestPlugin()])
    assert registry.cache_policy_for("toy") is PagedKVCache  # "auto"
    streams = registry.cache_policy_for("llamacpp")
    assert streams.layout == "streams" == registry.backends["llamacpp"].obj.kv_layout
    weights = tmp_path / "toy.bin"
    weights.write_bytes(b"")
    with pytest.raises(mf.ManifestError, match="serves the streams KV layout"):
        mf.resolve(mf.from_dict({"models": [
            {"name": "toy", "backend": "toy", "path": str(weights),
             "cache_policy": "llamacpp-streams"}]}), registry)
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=64)
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, streams)
    engine.start()
    assert not engine.wait_ready(5) and "paged" in (engine.error or "")
    engine.stop()


class FailingScheduler(FcfsScheduler):
    """Serves its first step, then raises: a plugin's bug met under load."""

    steps = 0

    def schedule(self):  # type: ignore[no-untyped-def]
        FailingScheduler.steps += 1
        if FailingScheduler.steps > 1:
            raise RuntimeError("the tier table is corrupt")
        return super().schedule()


def test_a_scheduler_that_raises_fails_its_model_not_the_server(tmp_path: Path) -> None:
    class Plugin(InTestPlugin):
        @hookimpl
        def register_schedulers(self, register):  # type: ignore[no-untyped-def]
            register("failing", FailingScheduler)

    registry = load_registry([Plugin()])
    weights = tmp_path / "toy.bin"
    weights.write_bytes(b"")
    manifest = mf.resolve(mf.from_dict({"models": [
        {"name": "bad", "backend": "toy", "scheduler": "failing", "path": str(weights),
         "max_seq_len": 64},
        {"name": "good", "backend": "toy", "path": str(weights), "max_seq_len": 64}]}),
        registry)
    deployment = Deployment(manifest, registry)
    deployment.start()
    assert deployment.wait_ready(10)

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            out = [await client.post("/v1/completions", json={
                "model": "bad", "prompt": "abcdef", "max_tokens": 20})]
            out.append(await client.post("/v1/completions", json={
                "model": "bad", "prompt": "abc", "max_tokens": 2}))
            out.append(await client.post("/v1/completions", json={
                "model": "good", "prompt": "abc", "max_tokens": 3}))
            out.append(await client.get("/ready"))
            return out

    try:
        during, after, good, ready = asyncio.run(go())
    finally:
        deployment.stop()
    # The request it was serving ends as a backend failure does: the server's fault, said.
    assert during.status_code == 500 and during.json()["error"]["code"] == "engine_error"
    assert "the tier table is corrupt" in during.json()["error"]["message"]
    assert after.status_code == 503 and "the tier table is corrupt" in after.text
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "abc"
    (bad_replica,) = [r for r in ready.json()["replicas"] if r["model"] == "bad"]
    assert "scheduler 'failing'" in bad_replica["error"]
