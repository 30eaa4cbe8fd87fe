"""Every child process of a real server is supervised: a worker stopped with SIGSTOP is
killed and restarted while the front end answers and the other replica serves, and the
chat-template sandbox's child, killed or stopped, is replaced, with a 503 and Retry-After
for the render it failed, as /ready and /metrics show."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess

pytestmark = pytest.mark.model

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[cluster]
engine = "process"
worker_timeout_s = 3

[[models]]
name = "smollm2"
backend = "BACKEND"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 1024
max_num_seqs = 2
replicas = 2
routing = "round_robin"
"""


@pytest.fixture(scope="module", params=FRONT_END_BACKENDS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(MANIFEST.replace("BACKEND", request.param),
                      tmp_path_factory.mktemp(f"supervised_{request.param}"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def ready(server: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/ready", timeout=30).json())


def wait_for(server: ServerProcess, condition: Any, timeout: float = 120.0) -> dict[str, Any]:
    """/ready's body once ``condition(body)`` holds; the timeout only gives up waiting."""
    deadline = time.monotonic() + timeout
    body = ready(server)
    while not condition(body) and time.monotonic() < deadline:
        time.sleep(0.1)
        body = ready(server)
    assert condition(body), body
    return body


def metric(server: ServerProcess, series: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert found, f"{series} is not in /metrics"
    return float(found.group(1))


def chat(server: ServerProcess, content: str = "Hi.", **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": content}],
        "max_tokens": 4, **body})


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def health_while(server: ServerProcess, busy: concurrent.futures.Future[Any]) -> int:
    """/health probes answered one after another until ``busy`` is done; each must be 200."""
    answered = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while not busy.done():
            assert client.get("/health").status_code == 200
            answered += 1
            time.sleep(0.05)
    return answered


def test_a_stopped_worker_is_killed_and_restarted_while_the_other_serves(
        server: ServerProcess, stopped: list[int]) -> None:
    body = wait_for(server, lambda b: b["ready"])
    pids = [r["runtime"]["pid"] for r in body["replicas"]]
    long = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Round robin: one long request on each replica.
        first = pool.submit(chat, server, "Tell me a story.", **long)
        second = pool.submit(chat, server, "Tell me another story.", **long)
        wait_for(server, lambda b: all(r["running"] == 1 for r in b["replicas"]))
        os.kill(pids[0], signal.SIGSTOP)
        stopped.append(pids[0])
        # The front end answers all along, until the watchdog kills the worker (3 s).
        answered = 0
        deadline = time.monotonic() + 120  # gives up waiting only
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while alive(pids[0]) and time.monotonic() < deadline:
                assert client.get("/health").status_code == 200
                answered += 1
                time.sleep(0.05)
        assert answered >= 1 and not alive(pids[0])
        responses = [first.result(), second.result()]
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 503], [r.text for r in responses]
    dead = next(r for r in responses if r.status_code == 503)
    assert dead.json()["error"]["code"] == "replica_lost" and "Retry-After" in dead.headers
    assert "stopped answering" in dead.json()["error"]["message"]
    served = next(r for r in responses if r.status_code == 200)
    assert served.json()["usage"]["completion_tokens"] == 300  # the other ran to its end
    body = wait_for(server, lambda b: b["ready"])
    victim, other = body["replicas"]
    assert victim["runtime"]["restarts"] == 1 and victim["runtime"]["pid"] != pids[0]
    assert other["runtime"]["restarts"] == 0 and other["runtime"]["pid"] == pids[1]
    assert metric(server, 'laya:replica_restarts_total{model_name="smollm2",replica="0"}') == 1
    assert chat(server).status_code == 200


def test_the_template_sandbox_is_replaced_when_killed_or_stopped(
        server: ServerProcess, stopped: list[int]) -> None:
    wait_for(server, lambda b: b["ready"])
    assert chat(server).status_code == 200
    sandbox = ready(server)["template_sandbox"]
    pid, restarts = sandbox["pid"], sandbox["restarts"]
    assert sandbox["up"] and isinstance(pid, int)
    # Killed while idle: replaced at once, and the next chat renders as before.
    os.kill(pid, signal.SIGKILL)
    sandbox = wait_for(server, lambda b: b["template_sandbox"]["pid"] != pid)["template_sandbox"]
    assert sandbox["restarts"] == restarts + 1 and sandbox["up"]
    assert sandbox["last_exit"] == "was killed by SIGKILL while idle"
    assert chat(server).status_code == 200
    assert metric(server, "laya:template_sandbox_restarts_total") == restarts + 1
    assert metric(server, "laya:template_sandbox_up") == 1
    # Stopped: the chat that needs it gets a 503 after the render's 2 s, while the server
    # answers, and the child is replaced for the next.
    pid = sandbox["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(chat, server)
        assert health_while(server, refused) >= 1
        response = refused.result()
    assert response.status_code == 503 and "Retry-After" in response.headers, response.text
    error = response.json()["error"]
    assert error["code"] == "template_unavailable" and "stopped answering" in error["message"]
    assert not alive(pid)
    assert chat(server).status_code == 200
    sandbox = ready(server)["template_sandbox"]
    assert sandbox["restarts"] == restarts + 2 and sandbox["pid"] != pid
    assert sandbox["last_exit"] == "stopped answering"
    assert metric(server, "laya:template_sandbox_restarts_total") == restarts + 2
