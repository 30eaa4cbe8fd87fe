"""The engine client with the toy backend: submit, cancel, events, state, and that what
crosses from the engine thread to the HTTP side is an immutable snapshot."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import attrs
import pytest
from toy_backend import END, ToyBackend, started_engine

import laya_core.http
from laya_core.backend import ModelConfig
from laya_core.engine.engine import Engine
from laya_core.engine.request import Request
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.engine.stream import GenerationStream
from laya_core.kv.policies import PagedKVCache
from laya_core.replica.client import (
    EngineState,
    EngineUnavailableError,
    LocalEngineClient,
    QueueFullError,
    RequestTooLongError,
)
from laya_core.types import FinishReason, SamplingParams, TokenEvent, Usage


def client(**config: object) -> LocalEngineClient:
    return LocalEngineClient(started_engine(**{"max_seq_len": 64, **config}))


def stop(c: LocalEngineClient) -> None:
    c._engine.stop()


async def events_of(stream: GenerationStream) -> list[TokenEvent]:
    return [event async for event in stream]


def test_submit_streams_events_and_the_final_one_carries_the_counts() -> None:
    c = client()

    async def go() -> tuple[GenerationStream, list[TokenEvent]]:
        stream = await c.submit(list(b"abc"), SamplingParams(max_tokens=5))
        return stream, await events_of(stream)

    stream, events = asyncio.run(go())
    assert "".join(e.text for e in events) == "abcab"
    # Tokens held for the next steps' leave with them as one event (engine/handover.py).
    assert sum(len(e.token_ids) for e in events) == 5 and len(events) < 5
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage == Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)
    assert stream.usage == events[-1].usage
    assert all(e.usage is None for e in events[:-1])
    stop(c)


def test_the_end_token_counts_as_generated() -> None:
    c = client()

    async def go() -> list[TokenEvent]:
        return await events_of(await c.submit([ord("a"), 0], SamplingParams(max_tokens=9)))

    events = asyncio.run(go())
    assert events[-1].token_ids == (END,) and events[-1].finish_reason is FinishReason.STOP
    assert "".join(e.text for e in events) == "a"
    assert events[-1].usage == Usage(2, 2)  # "a" and the end token
    stop(c)


def test_cancel_by_request_id_ends_the_stream_and_frees_the_replica() -> None:
    c = client(max_num_seqs=2, options={"step_delay_s": 0.005})

    async def go() -> list[TokenEvent]:
        stream = await c.submit(list(b"abcdef"), SamplingParams(max_tokens=50))
        events = []
        async for event in stream:
            events.append(event)
            if len(events) == 2:
                c.cancel(stream.request_id)
        c.cancel(stream.request_id)  # a finished request is left alone
        return events

    events = asyncio.run(go())
    assert events[-1].finish_reason is FinishReason.CANCELLED
    assert events[-1].usage is not None and events[-1].usage.completion_tokens < 50
    state = c.state()
    assert state.num_running == 0 and state.kv_used_tokens == 0
    assert state.finished[FinishReason.CANCELLED] == 1
    stop(c)


def test_submit_refuses_what_can_never_fit_and_what_overflows_the_queue() -> None:
    c = client(max_num_seqs=1, max_queue=1, options={"step_delay_s": 0.01})

    async def go() -> None:
        with pytest.raises(RequestTooLongError, match="65 tokens"):
            await c.submit(list(b"x" * 60), SamplingParams(max_tokens=5))
        running = await c.submit(list(b"ab"), SamplingParams(max_tokens=20))
        assert await running.wait_admitted() is None
        waiting = await c.submit(list(b"cd"), SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError):
            await c.submit(list(b"ef"), SamplingParams(max_tokens=2))
        assert c.state().rejections["queue_full"] == 1
        await events_of(running)
        await events_of(waiting)

    asyncio.run(go())
    stop(c)


def test_state_is_a_snapshot_that_later_steps_do_not_change() -> None:
    c = client(options={"step_delay_s": 0.01})

    async def go() -> None:
        stream = await c.submit(list(b"abc"), SamplingParams(max_tokens=6))
        await stream.wait_admitted()
        during = c.state()
        await events_of(stream)
        after = c.state()
        assert during.num_running == 1 and during.kv_used_tokens > 0
        assert during.finished[FinishReason.LENGTH] == 0
        assert after.num_running == 0 and after.finished[FinishReason.LENGTH] == 1
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            during.num_running = 5  # type: ignore[misc]

    asyncio.run(go())
    stop(c)


def test_info_and_tokenizer_wait_for_the_load() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=64,
                      options={"load_delay_s": 0.3})
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, PagedKVCache, replica_id=3)
    c = LocalEngineClient(engine)
    engine.start()
    assert c.state().state is EngineState.LOADING and not c.state().ready
    with pytest.raises(EngineUnavailableError, match="replica 3 is loading"):
        c.info()
    with pytest.raises(EngineUnavailableError):
        c.tokenizer()
    assert engine.wait_ready(5)
    info = c.info()
    assert (info.model, info.replica_id, info.backend_name) == ("toy", 3, "toy")
    assert info.max_seq_len == 64
    assert info.supports_prompt_logprobs and info.model_info.vocab_size == 257
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        info.max_seq_len = 1  # type: ignore[misc]
    tok = c.tokenizer()
    assert tok.encode("hé", add_special=True) == [104, 195, 169]
    assert tok.decode([104, 195, 169, END]) == "hé"
    assert tok.first_unknown([1, 300, 2]) == 300 and tok.first_unknown([1, 2]) is None
    engine.stop()


def test_a_failed_load_keeps_info_unavailable_with_the_reason() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", options={"fail_load": True})
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, PagedKVCache)
    c = LocalEngineClient(engine)
    engine.start()
    engine.wait_ready(5)
    state = c.state()
    assert state.state is EngineState.FAILED and "unreadable" in (state.error or "")
    with pytest.raises(EngineUnavailableError, match="failed"):
        c.info()


def test_a_reused_prefix_is_counted_as_cached_prompt_tokens() -> None:
    c = client(max_seq_len=128)
    prompt = list(b"The same long system prompt, asked again and again. ")

    async def go() -> tuple[Usage, Usage]:
        first = await c.submit(prompt, SamplingParams(max_tokens=4))
        await events_of(first)
        second = await c.submit(prompt, SamplingParams(max_tokens=4))
        await events_of(second)
        return first.usage, second.usage

    first, second = asyncio.run(go())
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < len(prompt)
    assert second.prompt_tokens == len(prompt)
    stop(c)


def test_the_stream_holds_no_engine_object() -> None:
    c = client()

    async def go() -> GenerationStream:
        stream = await c.submit(list(b"abc"), SamplingParams(max_tokens=3))
        await events_of(stream)
        return stream

    stream = asyncio.run(go())
    assert not any(isinstance(v, (Request, Engine)) for v in vars(stream).values())
    stop(c)


def _http_sources() -> list[tuple[str, ast.Module]]:
    folder = Path(laya_core.http.__file__).parent
    return [(p.name, ast.parse(p.read_text())) for p in sorted(folder.glob("*.py"))]


def test_the_http_layer_imports_no_engine_and_reaches_no_backend() -> None:
    """Everything the HTTP side needs comes from the engine client (laya_core/replica/client.py)."""
    for name, tree in _http_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("laya_core.engine.engine", "laya_core.backend",
                                           "laya_core.backend_types",
                                           "laya_core.engine.request"), name
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("engines", "backend", "seq", "engine"), \
                    f"{name}:{node.lineno} reads .{node.attr}"
