"""The example engine-level backend (examples/laya-backend-openai), installed as an outside
author's package is: a Laya front end whose model is served by two upstream Laya servers.
Chats go through streamed and whole, with the upstream's usage and its time as a layer of
its own; one prompt stays on one upstream; an upstream killed mid-stream ends that stream
with an error event, the next requests go to the other, and the health check brings it
back once it serves again. A JSON schema is passed on for the upstream to enforce; other
constraints are refused with a 400 naming their field."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM_MANIFEST, ServerProcess, free_port, serving

# The upstreams: the embedded model, small and on one thread each (CI has two cores).
UPSTREAM = SMOLLM_MANIFEST.replace("max_num_seqs = 8", "max_num_seqs = 2").replace(
    "embeddings = true", "[models.options]\nn_threads = 1")

FRONT = """
[server]
host = "127.0.0.1"
port = {{port}}

[[models]]
name = "relay"
backend = "openai"
path = "{a}/v1"
replicas = 2
max_seq_len = 8192
max_num_seqs = 4

[models.options]
upstreams = ["{a}/v1", "{b}/v1"]
model = "smollm2"
health_interval_s = 0.5
timeout_s = 30
"""

CHAT = {"model": "relay", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Name a colour."}]}


def test_laya_plugins_lists_it_with_its_package_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plugins"], check=True,
                         capture_output=True, text=True).stdout
    assert re.search(r"^  openai +laya-backend-openai 0\.1\.0 ", out, re.M), out


def upstream_at(port: int, workdir: Path) -> ServerProcess:
    """A ``laya serve`` of the embedded model on ``port`` (so that it can come back there)."""
    workdir.mkdir(exist_ok=True)
    server = ServerProcess(UPSTREAM.replace("{port}", str(port)), workdir)
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server.wait_ready()
    return server


def served(url: str) -> int:
    """Requests an upstream finished, from its /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return int(sum(float(v) for v in
                   re.findall(r"^laya:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


def replicas(url: str) -> list[dict[str, object]]:
    return list(httpx.get(f"{url}/ready").json()["replicas"])


# Upstreams a test started, stopped after the front end (one that stops first leaves its
# replica down, and a server with a replica down at its end exits 1).
LATER: list[ServerProcess] = []


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    root = tmp_path_factory.mktemp("backend_openai")
    a = upstream_at(free_port(), root / "a")
    b = upstream_at(free_port(), root / "b")
    try:
        with serving(FRONT.format(a=a.url, b=b.url), root) as front:
            yield front, a, b
    finally:
        for s in (a, b, *LATER):
            s.stop()


def test_chats_go_through_whole_and_streamed_with_usage_and_upstream_time(
        servers: tuple[ServerProcess, ServerProcess, ServerProcess]) -> None:
    front, a, b = servers
    r = httpx.post(f"{front.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    # The upstream's own count of its tokens (this front end counts the prompt in bytes).
    assert body["usage"]["completion_tokens"] == 4
    assert 0 < body["usage"]["prompt_tokens"] < len("Name a colour.") + 40
    assert re.search(r"upstream;dur=[0-9.]+", r.headers["server-timing"]), r.headers
    # The same prompt again: the prefix router keeps it on the upstream that served it.
    before = served(a.url), served(b.url)
    for _ in range(2):
        assert httpx.post(f"{front.url}/v1/chat/completions", json=CHAT,
                          timeout=60).status_code == 200
    grew = served(a.url) - before[0], served(b.url) - before[1]
    assert sorted(grew) == [0, 2], grew

    chunks = []
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", timeout=60,
                      json={**CHAT, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"])
    assert text == body["choices"][0]["message"]["content"]  # greedy: the same reply
    assert events[-1]["usage"]["completion_tokens"] == 4
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals[0]["laya_timing"]["upstream_ms"] > 0

    text = httpx.get(f"{front.url}/metrics").text
    assert re.search(r'^laya:engine_layer_seconds_total\{[^}]*layer="upstream"[^}]*\} [0-9.e-]+$',
                     text, re.M), text


def test_a_json_schema_is_the_upstreams_to_enforce_and_a_regex_is_refused(
        servers: tuple[ServerProcess, ServerProcess, ServerProcess]) -> None:
    front, _, _ = servers
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = httpx.post(f"{front.url}/v1/chat/completions", timeout=60, json={
        **CHAT, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"])["colour"] in ("red",
                                                                                 "blue")
    r = httpx.post(f"{front.url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "guided_regex": "[0-9]+"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    assert "JSON output formats only" in r.json()["error"]["message"]


def aborted(url: str) -> int:
    """Requests an upstream ended because its client went away, from its /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return int(sum(float(v) for v in re.findall(
        r'^laya:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text,
        re.M)))


def test_a_client_that_leaves_closes_the_upstream_request(
        servers: tuple[ServerProcess, ServerProcess, ServerProcess]) -> None:
    front, a, b = servers
    before = aborted(a.url) + aborted(b.url)
    long = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=long,
                      timeout=60) as s:
        assert s.status_code == 200
        next(line for line in s.iter_lines() if line.startswith("data: "))
    # The front end cancels the request, which closes its upstream request: the upstream
    # counts it aborted (its 400 tokens would end it "length").
    deadline = time.monotonic() + 30
    while aborted(a.url) + aborted(b.url) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(a.url) + aborted(b.url) == before + 1
    assert all(r["running"] == 0 for r in replicas(front.url))


def test_a_killed_upstream_ends_its_stream_and_the_other_serves_until_it_is_back(
        servers: tuple[ServerProcess, ServerProcess, ServerProcess],
        tmp_path: Path) -> None:
    front, a, b = servers
    by_url = {a.url: a, b.url: b}
    long = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=long,
                      timeout=60) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        busy = [r for r in replicas(front.url) if r["running"] == 1]
        assert len(busy) == 1, replicas(front.url)
        runtime = busy[0]["runtime"]
        assert isinstance(runtime, dict)
        victim = by_url[str(runtime["upstream"]).removesuffix("/v1")]
        victim.proc.kill()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    errors = [json.loads(c)["error"] for c in rest if c != "[DONE]" and "error" in json.loads(c)]
    assert errors and errors[0]["code"] == "replica_lost", rest[-3:]
    down = [r for r in replicas(front.url) if r["replica"] == busy[0]["replica"]][0]
    # Down, for the break; the health check retries every 0.5 s, and on a busy machine a
    # retry may already have put its own reason (the upstream refusing) in its place.
    assert down["state"] != "ready" and any(
        why in str(down["error"]) for why in ("broke off", "Connection refused")), down
    # The next requests go to the other upstream.
    for _ in range(3):
        r = httpx.post(f"{front.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
    # It comes back where it was, and the health check lets the router use it again.
    LATER.append(upstream_at(victim.port, tmp_path / "back"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(r["state"] == "ready" for r in replicas(front.url)):
            break
        time.sleep(0.2)
    assert all(r["state"] == "ready" for r in replicas(front.url)), replicas(front.url)


# llama-cpp-python's server, with llama.cpp's repacked weight buffers off: on a CPU with AMX
# they crash its first decode (a general protection fault in libggml-cpu, as llama-server's
# do without --no-repack), and the server has no option for them.
LLAMA_CPP_SERVER = """
import sys
import llama_cpp.llama_cpp as ll
defaults = ll.llama_model_default_params
def no_repack():
    params = defaults()
    params.use_extra_bufts = False
    return params
ll.llama_model_default_params = no_repack
from llama_cpp.server.__main__ import main
sys.argv[0] = "llama_cpp.server"
main()
"""


def test_llama_cpp_pythons_server_is_an_upstream_too(tmp_path: Path) -> None:
    """llama-cpp-python's OpenAI server (its server extra's packages are test
    dependencies, pyproject.toml) behind the example."""
    from laya_core.builtin.model_paths import embedded_file

    port = free_port()
    log = (tmp_path / "llama_cpp_server.log").open("wb")
    upstream = subprocess.Popen(
        [sys.executable, "-c", LLAMA_CPP_SERVER, "--model",
         embedded_file("smollm2-135m-instruct"), "--port", str(port), "--n_threads", "1",
         "--n_ctx", "1024",
         # By default it cuts a stream short when any other request comes, and GET
         # /v1/models (the example's health check) is one: under load one landed mid-stream.
         "--interrupt_requests", "False"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and upstream.poll() is None:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        front = FRONT.format(a=url, b=url).replace("replicas = 2", "replicas = 1").replace(
            'model = "smollm2"\n', "")
        with serving(front, tmp_path) as server:
            r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        upstream.terminate()
        upstream.wait(30)
        log.close()


# An upstream that refuses and stalls on request, for what a real server does only under
# load: a 429 with its own Retry-After, and no answer at all.
STUB = """
import asyncio, json, socket, sys
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
import uvicorn

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

def chunk(delta, finish=None, usage=None):
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta,
                                               "finish_reason": finish}],
                                  "usage": usage}) + "\\n\\n"

async def slowly(seconds):  # a piece every 0.1 s for that long
    for _ in range(max(1, int(seconds * 10))):
        yield chunk({"content": "a"})
        await asyncio.sleep(0.1)
    yield chunk({}, "stop", {"prompt_tokens": 1, "completion_tokens": 1})
    yield "data: [DONE]\\n\\n"

async def chat(request):
    said = (await request.json())["messages"][-1]["content"]
    if said.startswith("slow "):
        return StreamingResponse(slowly(float(said.split()[1])),
                                 media_type="text/event-stream")
    if said == "busy":
        return JSONResponse({"error": {"message": "too many requests", "type": "rate_limit"}},
                            status_code=429, headers={"Retry-After": "7"})
    if said == "broken":
        return JSONResponse({"error": {"message": "the server failed"}}, status_code=500)
    if said == "bad":
        return JSONResponse({"error": {"message": "top_p is out of range",
                                       "param": "top_p"}}, status_code=400)
    await asyncio.sleep(60)

app = Starlette(routes=[Route("/v1/models", models),
                        Route("/v1/chat/completions", chat, methods=["POST"])])
# Its own port, bound here and then said: a port chosen before it starts could be taken by
# another test's server in between, which would then answer in its place.
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


@contextlib.contextmanager
def stub_upstream() -> Iterator[str]:
    """The stub's base URL while it runs."""
    stub = subprocess.Popen([sys.executable, "-c", STUB], stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout is not None
        yield f"http://127.0.0.1:{int(stub.stdout.readline())}"
    finally:
        stub.kill()  # a graceful stop would wait for the request it never answers
        stub.wait(30)
        if stub.stdout is not None:
            stub.stdout.close()


def stub_front(url: str, limits: str = "") -> str:
    return FRONT.format(a=url, b=url).replace("replicas = 2", "replicas = 1").replace(
        'model = "smollm2"', 'model = "stub"').replace("timeout_s = 30", "timeout_s = 1"
    ).replace("max_num_seqs = 4\n", limits)


def ask_stub(server: ServerProcess, content: str, stream: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        **CHAT, "stream": stream, "messages": [{"role": "user", "content": content}]})


def test_an_upstreams_refusals_and_silence_keep_their_meaning(tmp_path: Path) -> None:
    with stub_upstream() as url, serving(stub_front(url), tmp_path) as server:
        busy = ask_stub(server, "busy")
        assert busy.status_code == 429 and busy.headers["retry-after"] == "7", busy.text
        bad = ask_stub(server, "bad")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
        broken = ask_stub(server, "broken")  # its fault, not the client's nor Laya's
        assert broken.status_code == 503 and broken.headers["retry-after"], broken.text
        assert "the server failed" in broken.json()["error"]["message"]
        silent = ask_stub(server, "silent")  # no answer within timeout_s
        assert silent.status_code == 503, silent.text
        assert "did not answer in time" in silent.json()["error"]["message"]
        # Neither marks the upstream down: it answered its health check all along.
        assert replicas(server.url)[0]["state"] == "ready"


def test_the_manifests_limits_hold_in_front_of_an_upstream(tmp_path: Path) -> None:
    """max_num_seqs = 1 and max_queue = 1 per upstream: one request runs, one waits (its
    wait is its queue time), one more is a 429, and a wait past queue_timeout_s a 503."""
    limits = "max_num_seqs = 1\nmax_queue = 1\nqueue_timeout_s = 4\n"
    with stub_upstream() as url, serving(stub_front(url, limits), tmp_path) as server, \
            httpx.Client(timeout=60) as http, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        def waiting(n: int) -> None:
            deadline = time.monotonic() + 30
            while replicas(server.url)[0]["waiting"] != n:
                assert time.monotonic() < deadline, replicas(server.url)
                time.sleep(0.02)

        with http.stream("POST", f"{server.url}/v1/chat/completions", json={
                **CHAT, "stream": True, "max_tokens": 1000,
                "messages": [{"role": "user", "content": "slow 60"}]}) as long:
            assert long.status_code == 200
            lines = long.iter_lines()  # held: a dropped iterator closes the response
            next(lines)  # it runs: the one place is taken
            queued = pool.submit(ask_stub, server, "slow 0.2")
            waiting(1)
            full = ask_stub(server, "slow 0.2")
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "queue_full" and full.headers["retry-after"]
            timed_out = queued.result()  # the long one holds its place past 4 s
            assert timed_out.status_code == 503, timed_out.text
            assert timed_out.json()["error"]["code"] == "queue_timeout"
            assert timed_out.headers["retry-after"]
        # The client left: its upstream request closed, and its place is free again.
        with http.stream("POST", f"{server.url}/v1/chat/completions", json={
                **CHAT, "stream": True, "max_tokens": 1000,
                "messages": [{"role": "user", "content": "slow 0.5"}]}) as short:
            assert short.status_code == 200
            lines = short.iter_lines()
            next(lines)
            queued = pool.submit(ask_stub, server, "slow 0.1", False)
            waiting(1)
        served = queued.result()
        assert served.status_code == 200, served.text
        queue_ms = float(re.search(r"queue;dur=([0-9.]+)", served.headers["server-timing"])[1])
        assert queue_ms > 0, served.headers["server-timing"]
        assert replicas(server.url)[0]["running"] == 0


def test_a_deployment_in_code_serves_from_one_event_loop_after_another(
        servers: tuple[ServerProcess, ServerProcess, ServerProcess]) -> None:
    import asyncio

    from laya_core.config import manifest as mf
    from laya_core.plugins import load_registry
    from laya_core.serving.deployment import Deployment
    from laya_core.types import SamplingParams

    _, a, _ = servers
    registry = load_registry()
    d = Deployment(mf.resolve(mf.from_dict({"models": [
        {"name": "relay", "backend": "openai", "path": f"{a.url}/v1", "max_seq_len": 4096,
         "options": {"model": "smollm2"}}]}), registry), registry)
    d.start()
    try:
        assert d.wait_ready(30), d.clients[0].state().error
        client = d.clients[0]
        prompt = d.chat_prompt(client, [{"role": "user", "content": "Name a colour."}])

        async def ask() -> str:
            stream = await client.submit(prompt, SamplingParams(max_tokens=3, temperature=0))
            return "".join([event.text async for event in stream])

        first = asyncio.run(ask())
        assert first and asyncio.run(ask()) == first  # a second loop, its own connections
    finally:
        d.stop()
