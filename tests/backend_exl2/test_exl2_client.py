"""The ExLlama replica client against a generator that behaves as exllamav2's dynamic
generator does (its result dicts: "started", then "streaming" with token_ids, an end with
eos_reason and the held tokens), so that everything but the library runs here: tokens
streamed as text, stop tokens, stop strings and max_tokens, cancellation, usage, refusals of
what it cannot honour, and a generator that fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from exl2_folders import write_exl2_folder
from laya_backend_exl2.client import ExlClient
from laya_backend_exl2.placement import Placement, Scratch
from laya_backend_exl2.runtime import Runtime, Settings
from laya_backend_exl2.tokenizer import load_tokenizer

from laya_core.backend import ModelConfig
from laya_core.engine.state import EngineState, UnsupportedParameterError
from laya_core.structured.spec import ConstraintSpec
from laya_core.types import FinishReason, SamplingParams, TokenEvent

REPLY = "Red, green and blue."


class FakeJob:
    def __init__(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                 stops: Sequence[int]) -> None:
        self.identifier, self.prompt, self.params = rid, list(prompt), params
        self.stops, self.sent = set(stops), 0
        self.cached_pages, self.cached_tokens = 0, 3


class FakeGenerator:
    """exllamav2's ExLlamaV2DynamicGenerator as its results show it (one token a pass)."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.pending: list[FakeJob] = []
        self.active: list[FakeJob] = []
        self.cancelled: list[int] = []
        self.fail = False
        self.pass_s = 0.0

    def enqueue(self, job: FakeJob) -> None:
        self.pending.append(job)

    def cancel(self, job: FakeJob) -> None:
        self.cancelled.append(job.identifier)
        for jobs in (self.pending, self.active):
            if job in jobs:
                jobs.remove(job)

    def iterate(self) -> list[dict[str, Any]]:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        time.sleep(self.pass_s)
        out: list[dict[str, Any]] = []
        for job in list(self.active):  # one token each; the pending ones start

            token = self.reply[job.sent % len(self.reply)]
            job.sent += 1
            r: dict[str, Any] = {"stage": "streaming", "identifier": job.identifier,
                                 "eos": False}
            ids = np.array([[token]])
            if token in job.stops:  # not released: held, with the stop token last
                r.update(eos=True, eos_reason="stop_token", held={"token_ids": ids},
                         cached_tokens=3)
            elif job.sent >= job.params.max_tokens:
                r.update(eos=True, eos_reason="max_new_tokens", token_ids=ids, cached_tokens=3)
            else:
                r["token_ids"] = ids
            if r["eos"]:
                self.active.remove(job)
            out.append(r)
        for job in self.pending:
            out.append({"stage": "started", "identifier": job.identifier, "eos": False})
        self.active += self.pending
        self.pending = []
        return out


class FakeRuntime(Runtime):
    library = "fake"
    reply: list[int] = []
    loaded: list[FakeRuntime] = []

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        runtime = cls(FakeGenerator(cls.reply), "fake 1.0")
        cls.loaded.append(runtime)
        return runtime

    def new_job(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                stops: Sequence[int]) -> Any:
        return FakeJob(rid, prompt, params, stops)

    def close(self) -> None:
        self.generator = None


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExlClient]:
    folder = write_exl2_folder(tmp_path_factory.mktemp("client") / "m")
    tok, info = load_tokenizer(folder, "")
    (eos,) = info.eog_token_ids
    FakeRuntime.reply = [*tok.encode(REPLY, add_special=False), eos]
    config = ModelConfig(name="exl", backend="exl2", path=str(folder), max_seq_len=256,
                         max_num_seqs=2)
    settings = Settings(path=str(folder), max_seq_len=256, max_num_seqs=2, chunk_tokens=256,
                        pool_tokens=512, kv_cache_dtype="f16",
                        placement=Placement(("cuda:0",), (3,), (0,), (Scratch(0, ""),)),
                        kv_bytes_per_token_per_layer=128)
    c = ExlClient(config, 0, "exl2", FakeRuntime, lambda: settings)
    c.health_interval_s = 0.05
    c.start()
    assert c.wait_ready(10), c.state().error
    yield c
    c.stop()


def generator() -> FakeGenerator:
    g = FakeRuntime.loaded[-1].generator
    assert isinstance(g, FakeGenerator)
    return g


def ask(client: ExlClient, cancel_after: int | None = None, prompt: str = "Name colours.",
        constraint: ConstraintSpec | None = None, **params: Any) -> list[TokenEvent]:
    async def run() -> list[TokenEvent]:
        ids = client.tokenizer().encode(prompt, add_special=True)
        stream = await client.submit(ids, SamplingParams(**params), constraint)
        events = []
        async for event in stream:
            events.append(event)
            if len(events) == cancel_after:
                stream.cancel()
        return events

    return asyncio.run(asyncio.wait_for(run(), 10))


def text_of(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def test_a_reply_streams_to_its_end_of_generation_token(client: ExlClient) -> None:
    events = ask(client, max_tokens=64, temperature=0)
    final = events[-1]
    assert text_of(events) == REPLY and final.finish_reason is FinishReason.STOP
    assert final.token_ids == (FakeRuntime.reply[-1],)  # the stop token, with no text
    assert final.usage is not None and final.timing is not None
    prompt = len(client.tokenizer().encode("Name colours.", add_special=True))
    assert (final.usage.prompt_tokens, final.usage.completion_tokens,
            final.usage.cached_tokens) == (prompt, len(FakeRuntime.reply), 3)
    assert len(final.timing.token_gaps_s) == len(FakeRuntime.reply) - 1
    assert all(len(e.token_ids) == 1 for e in events)


def test_max_tokens_ends_it_with_length(client: ExlClient) -> None:
    events = ask(client, max_tokens=3)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 3
    assert text_of(events) == client.tokenizer().decode(FakeRuntime.reply[:3])


def test_a_stop_string_ends_it_before_the_string_and_cancels_the_job(client: ExlClient) -> None:
    before = len(generator().cancelled)
    events = ask(client, max_tokens=64, stop=(" and",))
    assert text_of(events) == "Red, green" and events[-1].finish_reason is FinishReason.STOP
    assert len(generator().cancelled) == before + 1 and not generator().active


def test_stop_token_ids_and_ignore_eos(client: ExlClient) -> None:
    second = FakeRuntime.reply[1]
    events = ask(client, max_tokens=64, stop_token_ids=(second,))
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 2
    n = len(FakeRuntime.reply) + 2  # past the end-of-generation token
    events = ask(client, max_tokens=n, ignore_eos=True)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == n


def test_a_cancelled_request_leaves_the_generator_and_its_place(client: ExlClient) -> None:
    generator().pass_s = 0.01
    before = len(generator().cancelled)
    try:
        events = ask(client, cancel_after=2, max_tokens=200, ignore_eos=True)
    finally:
        generator().pass_s = 0.0
    assert events[-1].finish_reason is FinishReason.CANCELLED
    assert events[-1].usage is not None and 2 <= events[-1].usage.completion_tokens < 200
    assert len(generator().cancelled) == before + 1
    assert not generator().active and not generator().pending
    deadline = time.monotonic() + 5
    while client.state().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.state().num_running == 0
    assert client.state().finished[FinishReason.CANCELLED] >= 1


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"constraint": ConstraintSpec("json_object", "{}", "response_format")},
     "response_format"),
    ({"logprobs": 2}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_what_it_cannot_honour_is_refused_naming_the_field(client: ExlClient, kwargs: dict,
                                                           param: str) -> None:
    with pytest.raises(UnsupportedParameterError) as info:
        ask(client, **kwargs)
    assert info.value.param == param and "the exl2 backend of 'exl'" in str(info.value)


def test_a_failing_generator_ends_its_requests_and_the_replica_loads_again(
        client: ExlClient) -> None:
    failing = generator()
    failing.pass_s = 0.02

    async def run() -> list[TokenEvent]:
        ids = client.tokenizer().encode("Hi", add_special=True)
        stream = await client.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True))
        events = []
        async for event in stream:
            events.append(event)
            failing.fail = True
        return events

    events = asyncio.run(asyncio.wait_for(run(), 10))
    assert events[-1].finish_reason is FinishReason.ERROR and events[-1].replica_lost
    assert "illegal memory access" in (events[-1].error or "")
    deadline = time.monotonic() + 10
    while (client.restarts < 1 or client.state().state is not EngineState.READY) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.restarts == 1 and generator() is not failing
    assert text_of(ask(client, max_tokens=64)) == REPLY
    assert client.runtime()["library"] == "fake 1.0"
