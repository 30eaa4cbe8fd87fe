"""An engine-level backend (``kind = "engine"``) in a real deployment: the factory asks it
for each replica's client instead of building an engine, the client's thread loads until
it succeeds, and a replica marked down leaves the router's choices until it loads again.
The backend here is a whole small one: its "engine" echoes the prompt's bytes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import attrs
import pytest

from laya_core.backend import ModelConfig, ModelInfo
from laya_core.config import manifest as mf
from laya_core.engine.stream import ADMITTED, GenerationStream
from laya_core.hookspecs import hookimpl
from laya_core.models.files import ModelShape
from laya_core.models.tokenizer import Tokenizer
from laya_core.plugins import load_registry
from laya_core.replica.client import (
    EngineState,
    QueueFullError,
    QueueTimeoutError,
    ReplicaInfo,
    UnsupportedParameterError,
)
from laya_core.replica.engine_backend import EngineBackend, EngineBackendClient
from laya_core.routing.router import NoRouteError
from laya_core.serving.deployment import Deployment
from laya_core.structured.spec import ConstraintSpec
from laya_core.types import FinishReason, SamplingParams, TokenEvent, Usage

# Which replicas' engines answer (by the model's replica index); the test flips them.
UP: dict[int, threading.Event] = {}


class Bytes(Tokenizer):
    vocab_size = 256  # type: ignore[assignment]
    special_tokens = frozenset()  # type: ignore[assignment]

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,))


class EchoClient(EngineBackendClient):
    health_interval_s = 0.01

    def __init__(self, config: object, replica_id: int, index: int) -> None:
        super().__init__(config, replica_id)
        self.index = index

    def load(self) -> ReplicaInfo:
        if not UP[self.index].is_set():
            raise ConnectionError("the engine does not answer")
        info = ModelInfo(n_ctx_train=256, vocab_size=256, eog_token_ids=frozenset(),
                         chat_template="{{ messages[-1]['content'] }}", bos_token="",
                         eos_token="", add_bos=False)
        return self.replica_info(info, 256, "echo-engine")

    def tokenizer(self) -> Tokenizer:
        return Bytes()

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        if constraint is not None:
            raise UnsupportedParameterError(constraint.param, "no constraints here")
        await self.wait_for_room()
        stream = self.new_stream(0, len(prompt_token_ids))
        text = bytes(prompt_token_ids).decode()
        for event in (ADMITTED, TokenEvent(text, ()),
                      TokenEvent("", (), FinishReason.STOP, usage=Usage(1, 1))):
            stream.queue.put_nowait(event)
        self.count_finished(FinishReason.STOP, 1)
        return stream

    def cancel(self, request_id: int) -> None:
        pass


class EchoEngine(EngineBackend):
    name = "echo-engine"
    needs_model_file = False

    @classmethod
    def model_shape(cls, path: str) -> ModelShape:
        return ModelShape(architecture="echo", n_layers=0, n_heads=0, n_kv_heads=0,
                          head_dim_k=0, head_dim_v=0, hidden_size=0, vocab_size=256,
                          n_ctx_train=256, weights_bytes=0, weights_source="none")

    def engine_client(self, replica_id: int, index: int) -> EngineBackendClient:
        return EchoClient(self.config, replica_id, index)


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register(EchoEngine.name, EchoEngine)


def until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def routed(d: Deployment, n: int) -> set[int]:
    """The replicas ``n`` requests of different sessions are routed to, one at a time."""
    seen = set()
    for session in map(str, range(n)):
        replica = d.router.route("m", session)
        seen.add(replica)
        d.router.release(replica)
    return seen


@pytest.fixture
def deployment() -> Deployment:
    UP.clear()
    UP.update({0: threading.Event(), 1: threading.Event()})
    registry = load_registry([Plugin()])
    manifest = mf.resolve(mf.from_dict({"models": [
        {"name": "m", "backend": "echo-engine", "path": "http://127.0.0.1:9/echo", "replicas": 2,
         "max_seq_len": 256}]}), registry)
    d = Deployment(manifest, registry)
    yield d
    d.stop()


def test_replicas_join_leave_and_rejoin_the_router_as_their_engine_answers(
        deployment: Deployment) -> None:
    d = deployment
    assert all(isinstance(c, EchoClient) for c in d.clients)  # no engine was built
    assert [c.index for c in d.clients] == [0, 1]  # type: ignore[attr-defined]
    UP[1].set()
    d.start()
    until(lambda: d.clients[1].state().ready)
    assert not d.clients[0].state().ready
    assert "does not answer" in str(d.clients[0].state().error)
    assert routed(d, 4) == {1}
    UP[0].set()
    until(lambda: d.clients[0].state().ready)
    assert routed(d, 20) == {0, 1}
    # A request that finds its engine gone marks the replica down; the router skips it,
    # and the health check (its load) brings it back once the engine answers.
    UP[1].clear()
    client = d.clients[1]
    assert isinstance(client, EchoClient)
    client.mark_down("the engine went away")
    assert client.state().state is EngineState.LOADING
    assert client.state().error == "the engine went away"
    assert routed(d, 20) == {0}
    UP[1].set()
    until(lambda: client.state().ready)
    assert client.state().ready and client.restarts == 1
    UP[0].clear()
    UP[1].clear()
    for c in d.clients:
        assert isinstance(c, EchoClient)
        c.mark_down("gone")
    with pytest.raises(NoRouteError):
        d.router.route("m")


def test_its_streams_and_counters_reach_the_front_end(deployment: Deployment) -> None:
    d = deployment
    UP[0].set()
    UP[1].set()
    d.start()
    until(lambda: all(c.state().ready for c in d.clients))
    client = d.clients[0]
    prompt = d.chat_prompt(client, [{"role": "user", "content": "hello"}])
    assert prompt == list(b"hello")  # rendered by its template, tokenized by its tokenizer

    async def run() -> list[TokenEvent]:
        stream = await client.submit(prompt, SamplingParams(max_tokens=4))
        assert await stream.wait_admitted() is None
        return [e async for e in stream]

    events = asyncio.run(run())
    assert "".join(e.text for e in events) == "hello"
    assert events[-1].finish_reason is FinishReason.STOP
    state = client.state()
    assert state.finished == {FinishReason.STOP: 1} and state.num_running == 0
    spec = ConstraintSpec("regex", "start: /a/", "response_format")
    with pytest.raises(UnsupportedParameterError) as info:
        asyncio.run(client.submit(prompt, SamplingParams(), spec))
    assert info.value.param == "response_format"


def test_the_plan_counts_what_it_reports_and_no_grammars_it_refuses() -> None:
    from laya_core.memory.planner import make_plan

    registry = load_registry([Plugin()])
    manifest = mf.resolve(mf.from_dict({"models": [
        {"name": "m", "backend": "echo-engine", "path": "http://127.0.0.1:9/echo", "max_seq_len": 256},
        {"name": "s", "path": "embedded:smollm2-135m-instruct", "max_seq_len": 256}]}),
        registry)
    engine, step = make_plan(manifest, registry).replicas
    assert not EchoEngine.supports_constraints
    assert "grammars" not in {o.name for o in engine.profile.overheads}
    assert "grammars" in {o.name for o in step.profile.overheads}


class HoldClient(EchoClient):
    """Its requests run until the test finishes them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, 0, 0)
        self.streams: list[GenerationStream] = []
        self.waited: list[float] = []

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        waited = await self.wait_for_room()
        stream = self.new_stream(len(self.streams), len(prompt_token_ids))
        stream.queue.put_nowait(ADMITTED)
        self.streams.append(stream)
        self.waited.append(waited)
        return stream

    def finish(self, i: int) -> None:
        self.streams[i].queue.put_nowait(TokenEvent("", (), FinishReason.STOP))
        self.count_finished(FinishReason.STOP, 1)


def test_the_manifests_limits_admit_queue_and_refuse_its_requests() -> None:
    client = HoldClient(ModelConfig(name="m", backend="echo-engine", path="x",
                                    max_num_seqs=1, max_queue=1, queue_timeout_s=30))

    async def run() -> None:
        ask = lambda: client.submit([104], SamplingParams())  # noqa: E731
        await ask()  # runs: the one place
        second = asyncio.create_task(ask())
        while client.state().num_waiting == 0:
            await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="max_queue 1"):
            await ask()  # one more than the queue holds
        assert (client.state().num_running, client.state().num_waiting) == (1, 1)
        client.finish(0)  # its place goes to the one waiting
        await second
        assert client.waited[1] > 0 and client.state().num_running == 1
        client.config = attrs.evolve(client.config, queue_timeout_s=0.01)
        with pytest.raises(QueueTimeoutError, match="waited 0.01 s"):
            await ask()
        client.config = attrs.evolve(client.config, queue_timeout_s=30)
        leaver = asyncio.create_task(ask())
        while client.state().num_waiting == 0:
            await asyncio.sleep(0)
        leaver.cancel()  # the client went away while it waited
        with pytest.raises(asyncio.CancelledError):
            await leaver
        assert client.state().num_waiting == 0
        client.finish(1)
        assert client.state().num_running == 0
        await ask()  # the place is free again, with no wait
        assert client.waited[-1] == 0.0

    asyncio.run(run())
    assert client.state().rejections == {"queue_full": 1, "queue_timeout": 1}


def test_max_queue_0_refuses_at_once_and_no_limit_admits_all() -> None:
    config = ModelConfig(name="m", backend="echo-engine", path="x", max_num_seqs=1,
                         max_queue=0)
    client = HoldClient(config)

    async def run(client: HoldClient, n: int) -> None:
        for _ in range(n):
            await client.submit([104], SamplingParams())

    asyncio.run(run(client, 1))
    with pytest.raises(QueueFullError):
        asyncio.run(run(client, 1))
    unlimited = HoldClient(attrs.evolve(config, max_num_seqs=None))
    asyncio.run(run(unlimited, 50))  # the engine's own queue decides
    assert unlimited.state().num_running == 50
