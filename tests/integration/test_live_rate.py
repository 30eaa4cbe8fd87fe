"""/live's tokens/s against a real ``laya serve`` while a long stream decodes: polled 3 s or
more apart, as a background tab or a monitoring script polls, it reads a rate, as it does
at the page's 0.5 s, and once the stream ends it reads 0."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess, serving

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 2048
max_num_seqs = 2
"""
SLOW_POLL_S = 3.5
FAST_POLL_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(MANIFEST, tmp_path_factory.mktemp("live_rate")) as s:
        yield s


def latency(server: ServerProcess) -> dict:
    r = httpx.get(server.url + "/live", timeout=10)
    assert r.status_code == 200, r.text
    (model,) = r.json()["models"]
    return dict(model["latency"]) | {"running": sum(x["running"] for x in model["replicas"])}


class Stream:
    """A streamed completion that runs until closed, read on a thread as it comes."""

    def __init__(self, url: str) -> None:
        self.chunks = 0
        self.started = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream sent nothing"

    def _read(self, url: str) -> None:
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks += 1
                    self.started.set()
                if self.stop.is_set():
                    return  # closing the connection cancels the sequence

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def rates_while_tokens_flow(server: ServerProcess, stream: Stream, every_s: float,
                            count: int) -> list[float]:
    """The rates read by ``count`` polls ``every_s`` apart across which the stream received
    tokens. A machine shared with other work can stall a process for a while; a poll that
    follows a stall is passed over, as nothing flowed to be measured."""
    rates: list[float] = []
    before = stream.chunks
    latency(server)
    for _ in range(10 * count):
        time.sleep(every_s)
        chunks = stream.chunks  # before the poll: the server counted these tokens by then
        snapshot = latency(server)
        assert snapshot["running"] == 1, "the stream ended early"
        if chunks - before >= 3:
            rates.append(snapshot["tokens_per_s"])
            if len(rates) == count:
                return rates
        before = chunks
    pytest.fail(f"the stream received tokens in only {len(rates)} of {10 * count} intervals")


def test_tokens_per_s_does_not_depend_on_the_polling_period(server: ServerProcess) -> None:
    stream = Stream(server.url)
    try:
        slow = rates_while_tokens_flow(server, stream, SLOW_POLL_S, 2)  # before: 0.0 each
        fast = rates_while_tokens_flow(server, stream, FAST_POLL_S, 4)
    finally:
        stream.close()
    assert all(rate > 0 for rate in slow + fast), (slow, fast)
    # The sequence is cancelled at the next step; then the counter stands still.
    deadline = time.monotonic() + 30
    while latency(server)["running"]:
        assert time.monotonic() < deadline, "the sequence was never cancelled"
        time.sleep(0.1)
    # Idle: 3 s (RATE_S) after the last token the rate is 0, at either pace.
    for poll_s in (FAST_POLL_S, SLOW_POLL_S):
        idle = []
        for _ in range(math.ceil(3.0 / poll_s) + 1):
            idle.append(latency(server)["tokens_per_s"])
            time.sleep(poll_s)
        assert idle[-1] == 0.0, (poll_s, idle)
