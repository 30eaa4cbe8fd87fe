"""HTTP details against real servers: error types of every status, 405 with Allow, CORS,
and /metrics with or without the API key. Clients: httpx, raw sockets and the openai SDK.

A test whose requests reach the model runs on every backend's server; one refused before
that runs on llama.cpp's alone."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess

from laya_core.http.errors import error_type

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example.com"
MODEL = """
[[models]]
name = "{name}"
backend = "{backend}"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 256
max_num_seqs = {max_num_seqs}
max_queue = {max_queue}
"""
# No CORS, /metrics behind the key; short body limits to reach 408 and 413.
PLAIN = f"""
[server]
host = "127.0.0.1"
port = {{port}}
api_keys = ["{KEY}"]
max_body_bytes = 1024
body_timeout_s = 0.5
""" + MODEL.format(name="smollm2", max_num_seqs=2, max_queue=64, backend="{backend}")
# CORS for one origin, /metrics open; "full" runs one request and queues one: the third
# at once gets a 429.
BROWSER = f"""
[server]
host = "127.0.0.1"
port = {{port}}
api_keys = ["{KEY}"]
cors_origins = ["{ORIGIN}"]
metrics_need_api_key = false
""" + MODEL.format(name="smollm2", max_num_seqs=2, max_queue=64, backend="{backend}") \
    + MODEL.format(name="full", max_num_seqs=1, max_queue=1, backend="{backend}")
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@contextlib.contextmanager
def serving_with_key(manifest: str, workdir: Path) -> Iterator[ServerProcess]:
    """Like conftest's serving(), for a server whose /ready needs the key."""
    server = ServerProcess(manifest, workdir)
    try:
        deadline = time.monotonic() + 120
        while not _ready(server):
            assert server.proc.poll() is None, f"server exited early:\n{server.log()}"
            assert time.monotonic() < deadline, f"server not ready:\n{server.log()}"
            time.sleep(0.1)
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log()}"


def _ready(server: ServerProcess) -> bool:
    try:
        return httpx.get(f"{server.url}/ready", headers=AUTH, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# The fixtures serve llama.cpp unless a test asks for every backend with this.
def on_one_backend(fixture: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(fixture, FRONT_END_BACKENDS, indirect=True)


@pytest.fixture(scope="module", params=["llamacpp"])
def plain(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    backend = request.param
    with serving_with_key(PLAIN.replace("{backend}", backend),
                          tmp_path_factory.mktemp(f"plain_{backend}")) as server:
        server.backend = backend
        yield server


@pytest.fixture(scope="module", params=["llamacpp"])
def browser(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    backend = request.param
    with serving_with_key(BROWSER.replace("{backend}", backend),
                          tmp_path_factory.mktemp(f"browser_{backend}")) as server:
        server.backend = backend
        yield server


def error_of(r: httpx.Response, status: int, type_: str, code: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["code"]) == (type_, code), error
    return error


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/chat/completions", "POST"),
    ("OPTIONS", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/completions", "POST"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/v1/models/smollm2", "GET, HEAD"),
    ("GET", "/tokenize", "POST"),
])
def test_a_wrong_method_is_a_405_with_allow(plain: ServerProcess, method: str, path: str,
                                            allow: str) -> None:
    r = httpx.request(method, plain.url + path, headers=AUTH)
    error = error_of(r, 405, "invalid_request_error", "method_not_allowed")
    assert r.headers["allow"] == allow
    assert method in error["message"] and allow in error["message"]


def test_every_status_has_its_openai_type(plain: ServerProcess) -> None:
    url = plain.url
    error_of(httpx.get(f"{url}/v1/nothing", headers=AUTH), 404, "invalid_request_error",
             "unknown_url")
    error_of(httpx.get(f"{url}/v1/models/nothing", headers=AUTH), 404,
             "invalid_request_error", "model_not_found")
    error_of(httpx.post(f"{url}/v1/chat/completions", headers=AUTH,
                        json={**CHAT, "max_tokens": 0}), 400, "invalid_request_error",
             "invalid_value")
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
    error_of(r, 401, "authentication_error", "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    error_of(httpx.post(f"{url}/v1/chat/completions", headers=AUTH,
                        content=b" " * 2048), 413, "invalid_request_error", "body_too_large")
    assert error_type(500) == "server_error" and error_type(503) == "service_unavailable"
    assert error_type(429) == "rate_limit_error" and error_type(418) == "invalid_request_error"


def test_a_body_that_does_not_arrive_is_a_408(plain: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"model\":".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "body_timeout")


def test_the_openai_client_sees_the_405_and_404_objects(plain: ServerProcess) -> None:
    with openai.OpenAI(base_url=f"{plain.url}/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as e:
            client.get("/chat/completions", cast_to=object)
        assert e.value.status_code == 405 and e.value.type == "invalid_request_error"
        assert e.value.response.headers["allow"] == "POST"
        with pytest.raises(openai.NotFoundError) as nf:
            client.models.retrieve("nothing")
        assert nf.value.type == "invalid_request_error" and nf.value.code == "model_not_found"


@on_one_backend("plain")
def test_without_cors_no_cors_headers_and_metrics_need_the_key(plain: ServerProcess) -> None:
    r = httpx.options(f"{plain.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 401  # no CORS: a preflight is a plain unauthenticated request
    r = httpx.post(f"{plain.url}/v1/chat/completions", headers={**AUTH, "Origin": ORIGIN},
                   json=CHAT, timeout=60)
    assert r.status_code == 200
    assert not [h for h in r.headers if h.startswith("access-control-")]
    assert httpx.get(f"{plain.url}/metrics").status_code == 401
    assert httpx.get(f"{plain.url}/metrics", headers=AUTH).status_code == 200


PREFLIGHT_HEADERS = ("authorization, content-type, x-session-id, x-stainless-lang, "
                     "x-stainless-package-version, x-stainless-retry-count")


def test_a_preflight_is_answered_without_a_key(browser: ServerProcess) -> None:
    r = httpx.options(f"{browser.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": PREFLIGHT_HEADERS})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in PREFLIGHT_HEADERS.split(",")} <= allowed
    assert "access-control-allow-credentials" not in r.headers
    assert int(r.headers["access-control-max-age"]) > 0


def test_a_preflight_from_another_origin_is_refused(browser: ServerProcess) -> None:
    r = httpx.options(f"{browser.url}/v1/chat/completions", headers={
        "Origin": "https://evil.example.org", "Access-Control-Request-Method": "POST"})
    error = error_of(r, 400, "invalid_request_error", "cors_refused")
    assert "origin" in error["message"] and "access-control-allow-origin" not in r.headers


def exposed(r: httpx.Response) -> set[str]:
    return {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}


@on_one_backend("browser")
def test_cross_origin_responses_carry_cors_headers(browser: ServerProcess) -> None:
    headers = {**AUTH, "Origin": ORIGIN}
    r = httpx.post(f"{browser.url}/v1/chat/completions", headers=headers, json=CHAT,
                   timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "server-timing" in r.headers and "origin" in r.headers["vary"].lower()
    assert {"server-timing", "retry-after", "www-authenticate"} <= exposed(r)
    unauthorized = httpx.post(f"{browser.url}/v1/chat/completions", json=CHAT,
                              headers={"Origin": ORIGIN})
    error_of(unauthorized, 401, "authentication_error", "invalid_api_key")
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN
    full = fill_the_queue(browser.url, headers)
    error_of(full, 429, "rate_limit_error", "queue_full")
    assert full.headers["access-control-allow-origin"] == ORIGIN
    assert "retry-after" in full.headers and "retry-after" in exposed(full)
    other = httpx.post(f"{browser.url}/v1/chat/completions", json=CHAT, timeout=60,
                       headers={**AUTH, "Origin": "https://evil.example.org"})
    assert "access-control-allow-origin" not in other.headers


def fill_the_queue(url: str, headers: dict[str, str]) -> httpx.Response:
    """A request to "full" while one request runs there and another waits."""
    long = {**CHAT, "model": "full", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=headers,
                      json=long, timeout=60) as running:
        lines = running.iter_lines()  # held: a dropped iterator closes the connection
        assert next(lines).startswith("data: {")  # running: "full" has one sequence
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{url}/v1/chat/completions", headers=headers,
                                  json={**long, "stream": False, "max_tokens": 2}, timeout=60)
            deadline = time.monotonic() + 10
            while waiting_on_full(url) < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            r = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                           json={**CHAT, "model": "full"}, timeout=60)
            running.close()  # its sequence is cancelled, so the waiting one runs and ends
            assert waiting.result().status_code == 200
    return r


def waiting_on_full(url: str) -> int:
    replicas = httpx.get(f"{url}/ready", headers=AUTH).json()["replicas"]
    return sum(r["waiting"] for r in replicas if r["model"] == "full")


@on_one_backend("browser")
def test_the_openai_client_from_an_origin(browser: ServerProcess) -> None:
    with openai.OpenAI(base_url=f"{browser.url}/v1", api_key=KEY, max_retries=0,
                       default_headers={"Origin": ORIGIN}) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert raw.headers["access-control-allow-origin"] == ORIGIN
        assert raw.parse().choices[0].message.content is not None
    with openai.OpenAI(base_url=f"{browser.url}/v1", api_key="sk-wrong-0123456789",
                       max_retries=0, default_headers={"Origin": ORIGIN}) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.response.headers["access-control-allow-origin"] == ORIGIN


def test_metrics_open_when_the_manifest_says_so(browser: ServerProcess) -> None:
    r = httpx.get(f"{browser.url}/metrics")
    assert r.status_code == 200 and "laya:" in r.text
    assert httpx.get(f"{browser.url}/ready").status_code == 401  # the rest still needs it
    assert httpx.get(f"{browser.url}/v1/models").status_code == 401


@on_one_backend("browser")
def test_streams_carry_cors_headers(browser: ServerProcess) -> None:
    with httpx.stream("POST", f"{browser.url}/v1/chat/completions",
                      headers={**AUTH, "Origin": ORIGIN}, json={**CHAT, "stream": True},
                      timeout=60) as r:
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.read().rstrip().endswith(b"data: [DONE]")
