"""Models loaded on demand (laya_core/serving/residency.py) in a real deployment of the toy
backend, its engines on threads, planned against a budget: a model loads at its first
request when the plan has room, the least recently used idle model is unloaded when it has
not, a pinned model never is, the idle timer unloads, an unload waits for the request
running on the model, a model that fails to load blocks no other, and a load that finds
every loaded model busy gives up after its queue_timeout_s."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from toy_backend import PLUGIN

from laya_core.config import manifest as mf
from laya_core.memory.planner import Machine, make_plan
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.serving.residency import LoadFailedError, NoRoomError
from laya_core.types import FinishReason, SamplingParams

MIB = 1 << 20


def model(name: str, **entry: Any) -> dict[str, Any]:
    # The toy reads no weights; the embedded file gives the planner a shape to plan it by.
    return {"name": name, "backend": "toy", "path": "embedded:smollm2-135m-instruct",
            "max_seq_len": 64, "max_num_seqs": 2, "max_step_tokens": 16, **entry}


def deployment_of(models: list[dict[str, Any]], room_for: int) -> Deployment:
    """A deployment whose budget holds the runtime, the pinned models and ``room_for`` of
    its on-demand models (all planned alike), and not one more."""
    registry = load_registry([PLUGIN])
    draft = mf.resolve(mf.from_dict({"models": models}), registry)
    plan = make_plan(draft, registry)
    on_demand = [r for r in plan.replicas if r.config.on_demand]
    fixed = plan.runtime_bytes + sum(r.total_bytes for r in plan.pinned)
    budget = fixed + room_for * on_demand[0].total_bytes + MIB  # one more needs 400+ MiB
    manifest = mf.resolve(mf.from_dict({"memory": {"budget": budget}, "models": models}),
                          registry)
    return Deployment(manifest, registry, make_plan(manifest, registry))


@pytest.fixture
def started() -> Iterator[Callable[[list[dict[str, Any]], int], Deployment]]:
    made: list[Deployment] = []

    def start(models: list[dict[str, Any]], room_for: int) -> Deployment:
        d = deployment_of(models, room_for)
        made.append(d)
        d.start()
        assert d.wait_ready(10)
        return d

    yield start
    for d in made:
        d.stop()


def status(d: Deployment, name: str) -> str:
    resident = d.residency.status(name)
    assert resident is not None
    return str(resident["status"])


def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def ask(d: Deployment, name: str, max_tokens: int = 3) -> FinishReason:
    """One request as the HTTP side makes it: hold the model, submit, read to the end."""
    await d.residency.acquire(name)
    try:
        stream = await d.any_client(name).submit([1, 2, 3], SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))
    finally:
        d.residency.release(name)
    return [e async for e in stream][-1].finish_reason  # type: ignore[return-value]


def test_loads_on_first_use_and_unloads_the_least_recently_used(started: Any) -> None:
    d = started([model("pinned"), *(model(n, load="on_demand") for n in "abc")], 2)
    assert [status(d, n) for n in "abc"] == ["unloaded"] * 3
    assert d.residency.status("pinned") is None and d.ready  # pinned: loaded with it

    async def run() -> None:
        for name in "aba":  # a was used last
            assert await ask(d, name) is FinishReason.LENGTH
        assert await ask(d, "c") is FinishReason.LENGTH  # no room: b goes, not a

    asyncio.run(run())
    assert [status(d, n) for n in "abc"] == ["loaded", "unloaded", "loaded"]
    b = d.residency.status("b")
    assert b is not None and b["unloads"] == {"evicted": 1} and b["loads"] == 1
    assert d.residency.resident_bytes() <= d.plan.budget.bytes  # type: ignore[union-attr]
    assert d.clients_of("pinned")[0].state().ready  # pinned is never unloaded
    # An unloaded model's replica leaves the router; a load brings a fresh one.
    asyncio.run(ask(d, "b"))
    b = d.residency.status("b")
    assert b is not None and b["loads"] == 2


def test_a_gpu_holds_its_models_as_the_host_does(tmp_path: Any) -> None:
    """Models on a GPU (planned for a machine with one, ``laya plan --gpus``; the toy
    allocates nothing there): where the host has room for both but the GPU for one, the
    second's load unloads the first, and the GPU's planned share never passes its budget."""
    registry = load_registry([PLUGIN])
    gib = 1 << 30
    models = [model(n, load="on_demand", options={"gpu_bytes": 6 * gib}) for n in "ab"]
    manifest = mf.resolve(mf.from_dict({"models": models}), registry)
    plan = make_plan(manifest, registry, machine=Machine(gpus=(10 * gib,)))
    assert plan.fits and plan.gpu_room["cuda:0"] < 12 * gib
    assert plan.total_bytes * 3 < plan.budget.bytes  # the host holds both at once
    d = Deployment(manifest, registry, plan)
    d.start()
    try:
        assert d.wait_ready(10)

        async def run() -> None:
            assert await ask(d, "a") is FinishReason.LENGTH
            assert await ask(d, "b") is FinishReason.LENGTH

        asyncio.run(run())
        assert [status(d, n) for n in "ab"] == ["unloaded", "loaded"]
        a = d.residency.status("a")
        assert a is not None and a["unloads"] == {"evicted": 1}
    finally:
        d.stop()


def test_the_idle_timer_unloads(started: Any) -> None:
    d = started([model("a", load="on_demand", idle_unload_s=0.3), model("b", load="on_demand")],
                2)
    asyncio.run(ask(d, "a"))
    asyncio.run(ask(d, "b"))
    until(lambda: status(d, "a") == "unloaded")
    assert d.residency.status("a")["unloads"] == {"idle": 1}  # type: ignore[index]
    assert status(d, "b") == "loaded"  # no idle_unload_s: only for another's room


def test_an_unload_waits_for_the_running_request(started: Any) -> None:
    d = started([model("a", load="on_demand", options={"step_delay_s": 0.02})], 1)

    async def run() -> FinishReason:
        await d.residency.acquire("a")
        stream = await d.any_client("a").submit([1, 2, 3], SamplingParams(
            max_tokens=40, ignore_eos=True))
        d.residency.release("a")
        unloading = threading.Thread(target=d.residency.unload, args=("a",))
        unloading.start()
        while status(d, "a") != "unloading":
            await asyncio.sleep(0.005)
        events = [e async for e in stream]
        await asyncio.to_thread(unloading.join)
        assert sum(len(e.token_ids) for e in events) == 40  # whole: never cut
        return events[-1].finish_reason  # type: ignore[return-value]

    assert asyncio.run(run()) is FinishReason.LENGTH
    assert status(d, "a") == "unloaded"
    assert d.residency.status("a")["unloads"] == {"asked": 1}  # type: ignore[index]


def test_a_model_that_fails_to_load_blocks_no_other(started: Any) -> None:
    d = started([model("bad", load="on_demand", options={"fail_load": True}),
                 model("good", load="on_demand")], 1)
    with pytest.raises(LoadFailedError, match="unreadable"):
        asyncio.run(ask(d, "bad"))
    assert status(d, "bad") == "failed"
    with pytest.raises(LoadFailedError):  # failed stays failed: no load per request
        asyncio.run(ask(d, "bad"))
    assert asyncio.run(ask(d, "good")) is FinishReason.LENGTH  # its room was given back
    assert d.residency.status("bad")["loads"] == 0  # type: ignore[index]
    with pytest.raises(LoadFailedError):  # asked again, it tries again
        d.residency.load("bad").result(30)


def test_a_load_waits_for_room_then_gives_up_when_every_model_stays_busy(
        started: Any) -> None:
    d = started([model("a", load="on_demand", options={"step_delay_s": 0.1}),
                 model("b", load="on_demand", queue_timeout_s=0.5)], 1)

    async def run() -> None:
        await d.residency.acquire("a")
        stream = await d.any_client("a").submit([1, 2, 3], SamplingParams(
            max_tokens=60, ignore_eos=True))  # 6 s: longer than b's wait (cancelled)
        d.residency.release("a")
        with pytest.raises(NoRoomError, match="no room to load 'b'"):
            await d.residency.acquire("b")
        assert status(d, "a") == "loaded" and status(d, "b") == "unloaded"
        stream.cancel()
        [_ async for _ in stream]
        await d.residency.acquire("b")  # a is idle now: it goes, b loads
        d.residency.release("b")

    asyncio.run(run())
    assert status(d, "a") == "unloaded" and status(d, "b") == "loaded"


def test_the_requests_waiting_for_a_load_are_bounded_by_max_queue(started: Any) -> None:
    from laya_core.serving.residency import LoadQueueFullError

    d = started([model("a", load="on_demand", max_queue=2,
                       options={"load_delay_s": 0.5})], 1)

    async def run() -> None:
        waiting = [asyncio.create_task(d.residency.acquire("a")) for _ in range(2)]
        while d.residency.status("a")["waiting_for_load"] < 2:  # type: ignore[index]
            await asyncio.sleep(0.005)
        with pytest.raises(LoadQueueFullError, match="max_queue is 2"):
            await d.residency.acquire("a")
        await asyncio.gather(*waiting)  # the two get it once it has loaded
        for _ in waiting:
            d.residency.release("a")

    asyncio.run(run())
    assert status(d, "a") == "loaded"
