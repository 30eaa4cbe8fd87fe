"""Replicas in worker processes, on the toy backend: the protocol, refusals, cancels, a
worker killed mid-stream, restarts, and a worker that crashes at every load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from toy_backend import PLUGIN

from laya_core.config import manifest as mf
from laya_core.engine.embed_jobs import EmbeddingsUnsupportedError
from laya_core.plugins import load_registry
from laya_core.replica.client import EngineState, GrammarError, QueueFullError, RequestTooLongError
from laya_core.replica.supervisor import MAX_LOAD_CRASHES
from laya_core.serving.deployment import Deployment
from laya_core.structured import formats
from laya_core.types import FinishReason, SamplingParams

pytestmark = pytest.mark.slow  # worker processes

TESTS = str(Path(__file__).parents[2])


def deployment(monkeypatch: pytest.MonkeyPatch, replicas: int = 1,
               **options: object) -> Deployment:
    """Toy replicas in worker processes (the worker imports the toy from the test tree)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]))
    registry = load_registry([PLUGIN])
    manifest = mf.from_dict({"cluster": {"engine": "process"}, "models": [{
        "name": "toy", "backend": "toy", "path": "-", "replicas": replicas,
        "max_seq_len": 256, "max_num_seqs": 4, "max_queue": 2, "options": options}]})
    d = Deployment(manifest, registry, worker_plugins=["toy_backend:PLUGIN"])
    d.start()
    return d


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployment]:
    d = deployment(monkeypatch, replicas=2, step_delay_s=0.01)
    assert d.wait_ready(30), [c.state().error for c in d.clients]
    yield d
    d.stop()


async def generate(d: Deployment, replica: int, text: str, **params: object) -> tuple[str, str]:
    client = d.clients[replica]
    prompt = client.tokenizer().encode(text, add_special=True)
    stream = await client.submit(prompt, SamplingParams(**params))  # type: ignore[arg-type]
    out, finish = "", None
    async for event in stream:
        out += event.text
        finish = event
    assert finish is not None and finish.finish_reason is not None
    return out, finish.finish_reason.value if not finish.error else f"error: {finish.error}"


def test_workers_serve_and_refuse_as_engines_do(toy: Deployment) -> None:
    assert toy.processes and not toy.engines
    pids = {c.runtime()["pid"] for c in toy.clients}
    assert len(pids) == 2 and os.getpid() not in pids

    async def go() -> None:
        got = await asyncio.gather(*(generate(toy, i % 2, f"hello {i} ", max_tokens=9,
                                              temperature=0) for i in range(4)))
        assert got == [((f"hello {i} " * 2)[:9], "length") for i in range(4)]  # the toy repeats
        with pytest.raises(RequestTooLongError):
            await generate(toy, 0, "x", max_tokens=300)
        with pytest.raises(GrammarError) as e:
            spec = formats.json_schema({"type": "array", "uniqueItems": True}, "guided_json")
            await toy.clients[0].submit([1, 2], SamplingParams(), spec)
        assert e.value.param == "guided_json"
        spec = formats.from_body({"guided_choice": ["abc", "abd"]})
        client = toy.clients[1]
        stream = await client.submit([97, 98], SamplingParams(max_tokens=5), spec)
        text = "".join([e.text async for e in stream])
        assert text in ("abc", "abd")
        # Refusals keep their kind across the socket, embeddings' too (off for this model).
        with pytest.raises(EmbeddingsUnsupportedError, match="embeddings are off"):
            await client.embed([[97, 98]])

    asyncio.run(go())
    state = toy.clients[0].state()
    assert state.ready and state.finished[FinishReason.LENGTH] == 2  # its share of four


def test_a_full_queue_and_a_cancel(toy: Deployment) -> None:
    async def go() -> None:
        client = toy.clients[0]
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        streams = []
        for _ in range(4):  # four running: max_num_seqs
            streams.append(await client.submit([97] * 4, long))
            await streams[-1].wait_admitted()
        waiting = [await client.submit([98] * 4, long) for _ in range(2)]  # max_queue 2
        with pytest.raises(QueueFullError):
            await client.submit([99] * 4, long)
        for s in streams + waiting:
            s.cancel()
        ends = [[e async for e in s][-1].finish_reason for s in streams + waiting]
        assert set(ends) == {FinishReason.CANCELLED}

    asyncio.run(go())
    deadline = time.monotonic() + 5
    while toy.clients[0].state().kv_used_tokens and time.monotonic() < deadline:
        time.sleep(0.05)
    assert toy.clients[0].state().kv_used_tokens == 0


def test_a_killed_worker_ends_its_requests_and_comes_back(toy: Deployment) -> None:
    victim, other = toy.clients

    async def go() -> None:
        long = SamplingParams(max_tokens=150, ignore_eos=True)
        doomed = await victim.submit([97] * 4, long)
        spared = await other.submit([98] * 4, long)
        await asyncio.sleep(0.2)
        os.kill(victim.runtime()["pid"], signal.SIGKILL)
        events = [e async for e in doomed]
        assert events[-1].finish_reason is FinishReason.ERROR and events[-1].replica_lost
        assert "killed by SIGKILL" in (events[-1].error or "")
        assert victim.state().state is EngineState.LOADING  # restarting
        assert toy.router.route("toy") == other.replica_id  # the router skips the dead one
        toy.router.release(other.replica_id)
        # The other replica's stream runs to its end, untouched.
        rest = [e async for e in spared]
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(e.token_ids) for e in rest) == 150

    asyncio.run(go())
    deadline = time.monotonic() + 30
    while not victim.state().ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim.state().ready and victim.runtime()["restarts"] == 1
    from prometheus_client import generate_latest

    from laya_core.http.metrics import metrics_registry

    text = generate_latest(metrics_registry(toy)).decode()
    assert 'laya:replica_restarts_total{model_name="toy",replica="0"} 1.0' in text
    assert 'laya:replica_up{model_name="toy",replica="0"} 1.0' in text
    assert asyncio.run(generate(toy, victim.replica_id, "back again", max_tokens=4,
                                temperature=0)) == ("back", "length")


def test_a_worker_that_crashes_at_every_load_is_left_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("laya_core.replica.supervisor.BACKOFF_S", (0.05,))
    d = deployment(monkeypatch, crash_load=True)
    try:
        assert not d.wait_ready(60)
        state = d.clients[0].state()
        assert state.state is EngineState.FAILED and d.all_failed
        assert f"died while loading {MAX_LOAD_CRASHES} times" in (state.error or "")
        assert "SIGSEGV" in (state.error or "")
        assert "toy: about to crash while loading" in (state.error or "")  # its last output
    finally:
        d.stop()


def test_a_load_error_fails_at_once_without_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    d = deployment(monkeypatch, fail_load=True)
    try:
        assert not d.wait_ready(30)
        state = d.clients[0].state()
        assert state.state is EngineState.FAILED and "unreadable" in (state.error or "")
        assert d.clients[0].runtime()["restarts"] == 0
    finally:
        d.stop()


def on_demand(monkeypatch: pytest.MonkeyPatch, **models: dict[str, object]) -> Deployment:
    """Toy models loaded on demand, each in worker processes, with their options."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]))
    registry = load_registry([PLUGIN])
    manifest = mf.from_dict({"cluster": {"engine": "process"}, "models": [{
        "name": name, "backend": "toy", "path": "-", "max_seq_len": 256, "max_num_seqs": 2,
        "load": "on_demand", "options": options} for name, options in models.items()]})
    d = Deployment(manifest, registry, worker_plugins=["toy_backend:PLUGIN"])
    d.start()
    return d


async def ask_on_demand(d: Deployment, name: str) -> str:
    await d.residency.acquire(name)
    try:
        client = d.any_client(name)
        stream = await client.submit(client.tokenizer().encode("hi ", add_special=True),
                                     SamplingParams(max_tokens=4, temperature=0))
    finally:
        d.residency.release(name)
    return "".join([e.text async for e in stream])


def test_an_on_demand_worker_that_crashes_at_every_load_fails_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from laya_core.serving.residency import LoadFailedError

    monkeypatch.setattr("laya_core.replica.supervisor.BACKOFF_S", (0.05,))
    d = on_demand(monkeypatch, bad={"crash_load": True}, good={})
    try:
        with pytest.raises(LoadFailedError, match=f"died while loading {MAX_LOAD_CRASHES}"):
            asyncio.run(ask_on_demand(d, "bad"))
        assert d.residency.status("bad")["status"] == "failed"  # type: ignore[index]
        assert d.clients[0].state().state is EngineState.STOPPED  # its worker is gone
        assert asyncio.run(ask_on_demand(d, "good")) == "hi h"  # the other is unaffected
    finally:
        d.stop()


def test_a_worker_killed_during_its_on_demand_load_is_started_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("laya_core.replica.supervisor.BACKOFF_S", (0.05,))
    d = on_demand(monkeypatch, slow={"load_delay_s": 1.5})
    try:
        async def go() -> str:
            asking = asyncio.create_task(ask_on_demand(d, "slow"))
            while (pid := getattr(d.clients[0], "pid", None)) is None:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # in its load
            os.kill(pid, signal.SIGKILL)
            return await asking

        assert asyncio.run(go()) == "hi h"  # the load went on in a new worker
        status = d.residency.status("slow")
        assert status is not None and status["status"] == "loaded" and status["loads"] == 1
        assert d.clients[0].runtime()["restarts"] == 1
    finally:
        d.stop()
