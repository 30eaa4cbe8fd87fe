"""A worker process that stops answering, on the toy backend: the front end's event loop
never waits on it, the watchdog kills it (SIGKILL) and it restarts, its requests end with
the replica-lost error while its neighbour serves on, and a worker that is only busy, in a
long load or a long step, is left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import generate_latest
from toy_backend import PLUGIN

from laya_core.config import manifest as mf
from laya_core.config.table import ManifestError
from laya_core.http.metrics import metrics_registry
from laya_core.plugins import load_registry
from laya_core.replica.client import EngineState, EngineUnavailableError
from laya_core.replica.worker_client import WorkerEngineClient
from laya_core.serving.deployment import Deployment
from laya_core.types import FinishReason, SamplingParams

TESTS = str(Path(__file__).parents[2])


def deployment(monkeypatch: pytest.MonkeyPatch, timeout_s: float, replicas: int = 1,
               max_seq_len: int = 256, **options: object) -> Deployment:
    """Toy replicas in worker processes, killed after ``timeout_s`` of silence."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]))
    registry = load_registry([PLUGIN])
    manifest = mf.from_dict({
        "cluster": {"engine": "process", "worker_timeout_s": timeout_s},
        "models": [{"name": "toy", "backend": "toy", "path": "-", "replicas": replicas,
                    "max_seq_len": max_seq_len, "max_num_seqs": 4, "max_queue": 64,
                    "options": options}]})
    d = Deployment(manifest, registry, worker_plugins=["toy_backend:PLUGIN"])
    d.start()
    return d


def wait_for(condition: object, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until true; the timeout only gives up waiting."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def worker_pid(client: object) -> int:
    assert isinstance(client, WorkerEngineClient) and client.pid is not None
    return client.pid


@pytest.mark.slow  # worker processes
def test_a_stopped_worker_is_killed_and_restarted_while_its_neighbour_serves(
        monkeypatch: pytest.MonkeyPatch, stopped: list[int]) -> None:
    d = deployment(monkeypatch, timeout_s=3, replicas=2, step_delay_s=0.01)
    try:
        assert d.wait_ready(60), [c.state().error for c in d.clients]
        victim, other = d.clients
        pid = worker_pid(victim)

        async def go() -> None:
            long = SamplingParams(max_tokens=250, ignore_eos=True)
            doomed = await victim.submit([97] * 4, long)
            await doomed.wait_admitted()
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            late = asyncio.ensure_future(victim.submit([98] * 4, long))  # never acked
            events = [e async for e in doomed]
            assert events[-1].finish_reason is FinishReason.ERROR and events[-1].replica_lost
            assert "stopped answering" in (events[-1].error or "")
            with pytest.raises(EngineUnavailableError, match="stopped answering"):
                await late
            assert victim.state().state is EngineState.LOADING  # restarting
            # Its neighbour serves on, and the router sends it what comes meanwhile.
            assert d.router.route("toy") == other.replica_id
            d.router.release(other.replica_id)
            spared = await other.submit([99] * 4, SamplingParams(max_tokens=20))
            rest = [e async for e in spared]
            assert rest[-1].finish_reason is FinishReason.LENGTH

        asyncio.run(go())
        wait_for(lambda: victim.state().ready)
        assert victim.state().ready and victim.runtime()["restarts"] == 1
        assert worker_pid(victim) != pid and not psutil.pid_exists(pid)  # killed and reaped
        assert other.runtime()["restarts"] == 0
        text = generate_latest(metrics_registry(d)).decode()
        assert 'laya:replica_restarts_total{model_name="toy",replica="0"} 1.0' in text
        assert 'laya:replica_up{model_name="toy",replica="0"} 1.0' in text
    finally:
        d.stop()


@pytest.mark.slow  # worker processes
def test_the_event_loop_never_waits_on_a_stopped_worker(
        monkeypatch: pytest.MonkeyPatch, stopped: list[int]) -> None:
    """40 long prompts sent to a stopped worker fill its socket many times over (2.4 MB
    against a buffer of about 200 KB); the loop must run on while they wait for their acks.
    Were a send to block the loop, it would run again only once the worker did: the timer
    below resumes it, should that happen, so that the test fails instead of hanging."""
    d = deployment(monkeypatch, timeout_s=600, max_seq_len=32768)
    try:
        assert d.wait_ready(60), [c.state().error for c in d.clients]
        (client,) = d.clients
        pid = worker_pid(client)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        rescue = threading.Timer(120, os.kill, (pid, signal.SIGCONT))
        rescue.start()

        async def go() -> tuple[str, int]:
            params = SamplingParams(max_tokens=8)
            submits = [asyncio.ensure_future(client.submit([97] * 30000, params))
                       for _ in range(40)]
            await asyncio.sleep(0.5)  # the loop runs on
            worker_status = psutil.Process(pid).status()
            waiting = sum(not s.done() for s in submits)
            for s in submits:
                s.cancel()
            await asyncio.gather(*submits, return_exceptions=True)
            return worker_status, waiting

        worker_status, waiting = asyncio.run(go())
        rescue.cancel()
        assert worker_status == psutil.STATUS_STOPPED  # the loop ran while it was stopped
        assert waiting == 40  # each waits for its ack, none refused
        os.kill(pid, signal.SIGCONT)
        assert client.state().ready and client.runtime()["restarts"] == 0
    finally:
        d.stop()


@pytest.mark.slow  # worker processes
def test_a_worker_busy_in_a_long_load_and_a_long_step_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat comes from a thread of its own: a load and a step each twice as long
    as the silence allowed do not count as silence."""
    d = deployment(monkeypatch, timeout_s=3, load_delay_s=6, step_delay_s=6)
    try:
        assert d.wait_ready(120), [c.state().error for c in d.clients]
        (client,) = d.clients

        async def one_step() -> list[FinishReason | None]:
            stream = await client.submit([97] * 4, SamplingParams(max_tokens=1))
            return [e.finish_reason async for e in stream]

        assert asyncio.run(one_step())[-1] is FinishReason.LENGTH
        assert client.state().ready and client.runtime()["restarts"] == 0
    finally:
        d.stop()


@pytest.mark.slow  # worker processes
def test_a_worker_stopped_while_loading_is_killed_and_restarted(
        monkeypatch: pytest.MonkeyPatch, stopped: list[int]) -> None:
    # Stopped before its first word (its interpreter's start), it would have a minute.
    monkeypatch.setattr("laya_core.replica.worker_link.FIRST_WORD_S", 10.0)
    d = deployment(monkeypatch, timeout_s=2, load_delay_s=600)
    try:
        (client,) = d.clients
        wait_for(lambda: isinstance(client, WorkerEngineClient) and client.pid is not None)
        pid = worker_pid(client)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        wait_for(lambda: client.runtime()["restarts"] >= 1, timeout=180)
        assert client.runtime()["restarts"] == 1 and not psutil.pid_exists(pid)
        error = client.state().error or ""
        assert "stopped answering" in error and "while loading" in error
    finally:
        d.stop()  # a worker still loading is killed at once


@pytest.mark.parametrize(("cluster", "problem"), [
    ({"engine": "process", "worker_timeout_s": 0.5}, "between 1 and 3600"),
    ({"worker_timeout_s": 7200}, "between 1 and 3600"),
    ({"worker_timeout_s": "10"}, "expected int or float"),
])
def test_the_worker_timeout_is_checked(cluster: dict[str, object], problem: str) -> None:
    models = [{"name": "m", "backend": "llamacpp", "path": "embedded:smollm2-135m-instruct"}]
    with pytest.raises(ManifestError, match=problem):
        mf.from_dict({"cluster": cluster, "models": models})
    manifest = mf.from_dict({"cluster": {"worker_timeout_s": 30}, "models": models})
    assert manifest.cluster.worker_timeout_s == 30.0
    assert mf.from_dict({"models": models}).cluster.worker_timeout_s == 10.0
