"""The access log of a real server: one line per request, streams included, refusals too.

A test whose requests reach the model runs on every backend's server; one refused before
that runs on llama.cpp's alone."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess, serving, smollm_manifest

KEY = "sk-access-log-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The message of a `laya.access` record: method, path, status, then key=value fields.
LINE = re.compile(r"laya\.access: (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}|-)"
                  r"(?P<fields>(?: \S+)*)$")


def access_lines(server: ServerProcess) -> list[dict[str, str]]:
    lines = []
    for text in server.log().splitlines():
        if (m := LINE.search(text)) is not None:
            fields = dict(f.partition("=")[::2] for f in m["fields"].split())
            lines.append({"method": m["method"], "path": m["path"], "status": m["status"],
                          **fields})
    return lines


def logged(server: ServerProcess, path: str) -> list[dict[str, str]]:
    """The lines of ``path``, once the server wrote them (a stream's comes as it ends)."""
    time.sleep(0.2)
    return [line for line in access_lines(server) if line["path"] == path]


on_one_backend = pytest.mark.parametrize("server", FRONT_END_BACKENDS, indirect=True)


@pytest.fixture(scope="module", params=["llamacpp"])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """API keys on, so that a 401 from the key check is among the lines; llama.cpp unless a
    test asks for every backend."""
    backend = request.param
    manifest = smollm_manifest(backend).replace("[server]\n",
                                                f'[server]\napi_keys = ["{KEY}"]\n')
    s = ServerProcess(manifest, tmp_path_factory.mktemp(f"access_log_{backend}"))
    s.backend = backend
    try:
        s.wait_ready(api_key=KEY)
        yield s
    finally:
        assert s.stop() == 0, s.log()


def ms(value: str) -> float:
    assert re.fullmatch(r"\d+\.\d+", value), value
    return float(value)


@on_one_backend
def test_a_completion_is_logged_once_with_its_tokens_and_times(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": "smollm2", "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    (line,) = logged(server, "/v1/completions")
    usage = r.json()["usage"]
    assert (line["method"], line["status"], line["model"]) == ("POST", "200", "smollm2")
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"]
    # The same layers as the Server-Timing header, rounded to hundredths of a millisecond.
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", r.headers["server-timing"]))
    for layer in ("route", "queue", "prefill", "decode"):
        assert abs(ms(line[f"{layer}_ms"]) - float(timing[layer])) <= 0.01, layer
    assert ms(line["total_ms"]) >= ms(line["prefill_ms"]) + ms(line["decode_ms"])


@on_one_backend
def test_a_stream_is_logged_once_when_it_ends(server: ServerProcess) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, json=body,
                      timeout=60) as r:
        for data in r.iter_lines():
            if data.startswith("data: {"):
                usage = json.loads(data[6:]).get("usage") or usage
    assert usage is not None
    (line,) = logged(server, "/v1/chat/completions")
    assert (line["method"], line["status"], line["model"]) == ("POST", "200", "smollm2")
    assert int(line["completion_tokens"]) == usage["completion_tokens"]
    assert ms(line["decode_ms"]) > 0 and "disconnected" not in line


@on_one_backend
def test_a_stream_the_client_left_is_logged_as_disconnected(server: ServerProcess) -> None:
    before = len(logged(server, "/v1/completions"))
    body = {"model": "smollm2", "prompt": "Tell a long story.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body,
                      timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 10
    while len(lines := logged(server, "/v1/completions")) == before:
        assert time.monotonic() < deadline, "the abandoned stream was never logged"
    (line,) = lines[before:]
    assert line["status"] == "200" and "disconnected" in line
    assert "completion_tokens" not in line  # it never completed


@pytest.mark.parametrize(("method", "path", "headers", "body", "status"), [
    ("POST", "/v1/images/generations", AUTH, {}, "404"),  # a route Laya does not serve
    ("GET", "/v1/models", {}, None, "401"),
    ("POST", "/tokenize", AUTH, {"model": "gpt-9", "prompt": "x"}, "404"),
    ("POST", "/detokenize", AUTH, {"model": "smollm2", "tokens": "x"}, "400"),
])
def test_a_refused_request_is_logged_with_its_status(
        server: ServerProcess, method: str, path: str, headers: dict[str, str],
        body: dict[str, object] | None, status: str) -> None:
    before = len(logged(server, path))
    r = httpx.request(method, f"{server.url}{path}", headers=headers, json=body, timeout=30)
    assert str(r.status_code) == status
    lines = logged(server, path)
    assert len(lines) == before + 1
    assert (lines[-1]["method"], lines[-1]["status"]) == (method, status)
    assert "model" not in lines[-1] and ms(lines[-1]["total_ms"]) >= 0


def test_a_path_cannot_forge_a_log_line(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/v1/x%0Alaya.access:%20GET%20/forged%20200", timeout=30)
    assert r.status_code == 401
    assert not logged(server, "/forged")
    assert logged(server, "/v1/x\\x0alaya.access:\\x20GET\\x20/forged\\x20200")


def test_a_refused_completion_is_logged_with_its_status(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30, json={
        "model": "smollm2", "prompt": "x", "max_tokens": 5000})
    assert r.status_code == 400
    lines = logged(server, "/v1/completions")
    assert lines[-1]["status"] == "400" and "completion_tokens" not in lines[-1]


@pytest.mark.parametrize("backend", FRONT_END_BACKENDS)
def test_no_access_log_when_switched_off(tmp_path: Path, backend: str) -> None:
    manifest = smollm_manifest(backend).replace("[server]\n", "[server]\naccess_log = false\n")
    with serving(manifest, tmp_path) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
        assert "laya.access" not in server.log()
