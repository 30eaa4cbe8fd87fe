"""SIGTERM: stop accepting, let in-flight streams finish (up to the timeout), exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}
shutdown_timeout_s = %s

[[models]]
name = "smollm2"
backend = "%s"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 2048
max_num_seqs = 2
"""


def stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    result: dict = {"chunks": 0, "finish": None, "tokens": 0, "done": False, "error": None}
    first = threading.Event()

    def run() -> None:
        # ignore_eos: the stream runs to max_tokens whatever a backend's sampler draws (a
        # special token it draws then has no text, so no chunk: the usage counts tokens).
        body = {"model": "smollm2", "prompt": "Write a long story.", "max_tokens": max_tokens,
                "stream": True, "temperature": 0.7, "seed": 1, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        result["done"] = True
                    elif line.startswith("data: {"):
                        result["chunks"] += 1
                        first.set()
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            result["tokens"] = chunk["usage"]["completion_tokens"]
                        for choice in chunk["choices"]:
                            result["finish"] = choice["finish_reason"] or result["finish"]
        except httpx.HTTPError as e:
            result["error"] = type(e).__name__
        finally:
            first.set()

    thread = threading.Thread(target=run)
    thread.start()
    first.wait(30)
    return thread, result


@pytest.mark.parametrize("backend", FRONT_END_BACKENDS)
def test_sigterm_lets_a_stream_finish_and_refuses_new_connections(tmp_path: Path,
                                                                  backend: str) -> None:
    server = ServerProcess(MANIFEST % (30, backend), tmp_path)
    server.wait_ready()
    thread, result = stream_in_background(server.url, 40)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        refused = httpx.get(f"{server.url}/health", timeout=2).status_code != 200
    except httpx.HTTPError:
        refused = True
    thread.join(60)
    code = server.proc.wait(30)
    server.stop()
    assert refused, "a new connection was served after SIGTERM"
    assert result["finish"] == "length" and result["done"] and result["tokens"] == 40
    assert code == 0, server.log()


@pytest.mark.parametrize("backend", FRONT_END_BACKENDS)
def test_sigterm_cancels_what_outlives_the_timeout(tmp_path: Path, backend: str) -> None:
    server = ServerProcess(MANIFEST % (1, backend), tmp_path)
    server.wait_ready()
    thread, result = stream_in_background(server.url, 1500)
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    thread.join(30)
    server.stop()
    assert code == 0, server.log()
    # Cut at the timeout: the stream never reached its 1500 tokens or its [DONE].
    assert not result["done"] and result["chunks"] < 1500, result
