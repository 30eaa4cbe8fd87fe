"""The engine thread with the toy backend: order, cancellation, limits, failures."""

from __future__ import annotations

import asyncio

import pytest
from toy_backend import started_engine

from laya_core.engine.engine import Engine
from laya_core.engine.limits import RequestTooLongError
from laya_core.types import FinishReason, SamplingParams


def engine(**config: object) -> Engine:
    return started_engine(**{"max_seq_len": 64, **config})


def test_cancel_leaves_at_the_next_step_and_frees_the_cache() -> None:
    e = engine(max_num_seqs=2, options={"step_delay_s": 0.005})

    async def go() -> tuple[list[str], FinishReason | None]:
        stream = e.submit(list(b"abcdef"), SamplingParams(max_tokens=50))
        texts = []
        async for event in stream:
            texts.append(event.text)
            if len(texts) == 3:
                stream.cancel()
            if event.finish_reason:
                return texts, event.finish_reason
        return texts, None

    texts, reason = asyncio.run(go())
    assert reason is FinishReason.CANCELLED
    assert len(texts) < 50
    assert e.kv_usage == 0.0 and e.num_running == 0
    assert not e.backend.started  # type: ignore[attr-defined]
    e.stop()


def test_requests_longer_than_max_seq_len_are_refused_up_front() -> None:
    e = engine()

    async def go() -> None:
        e.submit(list(b"x" * 60), SamplingParams(max_tokens=5))

    with pytest.raises(RequestTooLongError, match="65 tokens"):
        asyncio.run(go())
    e.stop()


def test_more_requests_than_slots_all_complete_in_full() -> None:
    e = engine(max_num_seqs=2, max_step_tokens=4)

    async def one(i: int) -> str:
        prompt = f"<{i}>".encode()
        stream = e.submit(list(prompt), SamplingParams(max_tokens=2 * len(prompt)))
        return "".join([ev.text async for ev in stream])

    async def go() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(7)))

    assert asyncio.run(go()) == [f"<{i}><{i}>" for i in range(7)]
    e.stop()


def test_a_failing_step_fails_its_sequences_and_the_engine_goes_on() -> None:
    e = engine()
    backend = e.backend
    real_step = backend.step
    calls = {"n": 0}

    def flaky(items):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real_step(items)

    backend.step = flaky  # type: ignore[method-assign]

    async def go() -> tuple[list, str]:
        failed = [ev async for ev in e.submit(list(b"ab"), SamplingParams(max_tokens=3))]
        ok = "".join([ev.text async for ev in e.submit(list(b"cd"), SamplingParams(max_tokens=3))])
        return failed, ok

    failed, ok = asyncio.run(go())
    assert failed[-1].finish_reason is FinishReason.ERROR and "device lost" in failed[-1].error
    assert ok == "cdc"
    assert e.kv_usage == 0.0
    e.stop()


def test_a_kv_op_that_fails_fails_its_sequence_and_the_others_go_on() -> None:
    """A backend that raises while starting one sequence (its sampler could not be built):
    that request ends with an error naming the cause, the one beside it in the same step is
    exact, and the engine serves the next."""
    e = engine(max_num_seqs=4, options={"step_delay_s": 0.002})
    backend = e.backend
    real_start = backend.start_sequence

    def start(seq_id: int, params: SamplingParams) -> None:
        if params.seed == 13:
            raise MemoryError("no room for the sampler")
        real_start(seq_id, params)

    backend.start_sequence = start  # type: ignore[method-assign]

    async def text(prompt: bytes, seed: int | None = None) -> tuple[str, FinishReason | None,
                                                                     str | None]:
        events = [ev async for ev in e.submit(list(prompt),
                                              SamplingParams(max_tokens=4, seed=seed))]
        return "".join(ev.text for ev in events), events[-1].finish_reason, events[-1].error

    async def go() -> list[tuple[str, FinishReason | None, str | None]]:
        return list(await asyncio.gather(text(b"abc"), text(b"xyz", seed=13)))

    (ok, ok_reason, _), (_, reason, error) = asyncio.run(go())
    assert (ok, ok_reason) == ("abca", FinishReason.LENGTH)
    assert reason is FinishReason.ERROR and error is not None
    assert "KV cache" in error and "no room for the sampler" in error
    assert asyncio.run(text(b"pq"))[:2] == ("pqpq", FinishReason.LENGTH)
    assert e.kv_usage == 0.0 and e.num_running == 0 and e.state.name == "READY"
    e.stop()


def test_a_request_whose_loop_closed_does_not_stop_the_engine() -> None:
    e = engine(options={"step_delay_s": 0.002})

    async def abandon() -> None:
        e.submit(list(b"abcdef"), SamplingParams(max_tokens=40))  # never read

    asyncio.run(abandon())  # the loop closes while the engine still generates for it

    async def later() -> str:
        stream = e.submit(list(b"xy"), SamplingParams(4))
        return "".join([ev.text async for ev in stream])

    assert asyncio.run(asyncio.wait_for(later(), 10)) == "xyxy"
    assert e.state.value == "ready"
    e.stop()


def test_max_queue_zero_serves_when_room_is_free_and_refuses_when_not() -> None:
    """max_queue = 0 means "no waiting": an idle engine runs the request, a full one refuses."""
    e = engine(max_num_seqs=1, max_queue=0, options={"step_delay_s": 0.01})

    async def go() -> None:
        first = e.submit(list(b"abc"), SamplingParams(max_tokens=30))
        assert await first.wait_admitted() is None
        second = e.submit(list(b"xyz"), SamplingParams(max_tokens=2))
        refused = await second.wait_admitted()
        assert refused is not None and refused.finish_reason is FinishReason.REJECTED
        assert "max_queue is 0" in (refused.error or "")
        text = "".join([ev.text async for ev in first])
        assert len(text) == 30
        third = e.submit(list(b"xyz"), SamplingParams(max_tokens=2))
        assert await third.wait_admitted() is None  # room again: it runs
        assert "".join([ev.text async for ev in third]) == "xy"

    asyncio.run(go())
    assert e.rejections["queue_full"] == 1
    e.stop()


class CountingCourier:
    """The running loop as the engine's courier, counting each hand-over's events and the
    tokens they carry."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: list[int] = []
        self.tokens: list[int] = []

    def call_soon_threadsafe(self, callback, *args):  # type: ignore[no-untyped-def]
        self.events.append(len(args[0]))
        self.tokens.append(sum(len(event.token_ids) for _, event in args[0]))
        return self.loop.call_soon_threadsafe(callback, *args)


def handovers(interval_ms: float, step_s: float,
              max_tokens: int) -> tuple[list[str], list[int], list[int]]:
    """One request's events' texts, and how many events and tokens each hand-over carried."""
    e = engine(options={"step_delay_s": step_s}, stream_interval_ms=interval_ms)

    async def go() -> tuple[list[str], list[int], list[int]]:
        courier = CountingCourier()
        stream = e.submit(list(b"abcdef"), SamplingParams(max_tokens=max_tokens), courier)
        return [ev.text async for ev in stream], courier.events, courier.tokens

    try:
        return asyncio.run(go())
    finally:
        e.stop()


def test_decode_steps_tokens_leave_together_within_the_stream_interval() -> None:
    texts, events, tokens = handovers(0, 0.002, 20)
    assert "".join(texts) == "abcdefabcdefabcdefab"
    assert len(texts) == 20  # each step's token an event of its own
    assert len(events) >= 20 and set(events) == {1}  # the admission, then each token
    # A long interval: the admission and the first token leave at once (TTFT), the rest
    # four steps' tokens a hand-over (HELD_STEPS), the last with the final event, and a
    # hand-over's tokens are one event.
    texts, events, tokens = handovers(1000, 0.002, 20)
    assert texts == ["a", "bcde", "fabc", "defa", "bcde", "fab"]
    assert events == [1, 1, 1, 1, 1, 1, 1]
    assert tokens == [0, 1, 4, 4, 4, 4, 3]


def test_no_token_waits_longer_than_the_interval_allows() -> None:
    # Steps of at least 10 ms and 30 ms to leave: a token waits for two more steps at most.
    texts, events, tokens = handovers(30, 0.010, 30)
    assert "".join(texts) == ("abcdef" * 5)
    assert tokens[:2] == [0, 1] and max(tokens) <= 3 and sum(tokens) == 30
    assert set(events) == {1}
