"""The error battery and API keys, against the app in-process with the toy backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from toy_backend import toy_deployment

from laya_core.http import create_app
from laya_core.serving.deployment import Deployment

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = toy_deployment(tmp_path_factory.mktemp("toy"),
                       [{"name": "toy", "max_seq_len": 64, "max_num_seqs": 2}],
                       server={"api_keys": [KEY], "max_body_bytes": 4096})
    d.start()
    assert d.wait_ready(10)
    yield d
    d.stop()


def call(deployment: Deployment, method: str, path: str, key: str | None = KEY,
         **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(deployment))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def test_api_keys_guard_everything_but_health(deployment: Deployment) -> None:
    assert call(deployment, "GET", "/health", key=None).status_code == 200
    for path in ("/v1/models", "/ready", "/metrics"):
        r = call(deployment, "GET", path, key=None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert call(deployment, "GET", path, key="sk-wrong-0123456789").status_code == 401
        assert call(deployment, "GET", path).status_code == 200
    r = call(deployment, "POST", "/v1/completions", key=None, json={"model": "toy"})
    assert r.status_code == 401


GOOD = {"model": "toy", "prompt": "abc", "max_tokens": 3}
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {**GOOD, "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "n": 99}, 400, "n"),
    ("/v1/completions", {**GOOD, "stop": [1]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {**GOOD, "echo": True, "stream": True}, 400, "echo"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 999]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 80}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "abc"}, 400, "model"),
    ("/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", [1, 2], 400, "body"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"},
                              "guided_regex": "a+"}, 400, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     400, "structured_outputs.choice"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "has space"}}]}, 400, "tools[0].function.name"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "4"}]}, 400,
     "messages[0].tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{nope"}}]}]}, 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/completions", {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("/tokenize", {"model": "toy"}, 400, "prompt"),
    ("/detokenize", {"model": "toy", "tokens": ["a"]}, 400, "tokens"),
])
def test_invalid_requests_name_the_field(deployment: Deployment, path: str, body: Any,
                                         status: int, param: str) -> None:
    r = call(deployment, "POST", path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_and_oversized_bodies(deployment: Deployment) -> None:
    r = call(deployment, "POST", "/v1/completions", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = call(deployment, "POST", "/v1/completions", content=b"\xff\xfe")
    assert r.status_code == 400
    r = call(deployment, "POST", "/v1/completions",
             json={**GOOD, "prompt": "x" * 10_000})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_unknown_paths_and_methods_use_the_error_shape(deployment: Deployment) -> None:
    r = call(deployment, "GET", "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = call(deployment, "GET", "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_a_good_request_still_works(deployment: Deployment) -> None:
    r = call(deployment, "POST", "/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


def post_raw(deployment: Deployment, path: str, body: bytes) -> httpx.Response:
    return call(deployment, "POST", path, content=body)


def assert_refused(r: httpx.Response, param: str | None, status: int = 400) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error


def test_a_401_names_the_bearer_scheme(deployment: Deployment) -> None:
    for key in (None, "sk-wrong-0123456789"):
        r = call(deployment, "POST", "/v1/completions", key=key, json=GOOD)
        assert_refused(r, None, 401)
        assert r.headers["WWW-Authenticate"] == "Bearer"


RAW_CHAT = b'{"model": "toy", "messages": [{"role": "user", "content": %s}]}'


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", RAW_CHAT % b'"a\\ud800"', "messages[0].content"),
    ("/v1/chat/completions", RAW_CHAT % b'[{"type": "text", "text": "\\udfff b"}]',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"model": "toy", "prompt": "a\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model": "toy", "prompt": ["ok", "a\\uDBFF"]}', "prompt[1]"),
    ("/v1/completions", b'{"model": "toy", "prompt": "a\xed\xa0\x80"}', "prompt"),  # raw bytes
    ("/v1/completions", b'{"model": "toy", "prompt": "ok", "stop": ["\\ud800"]}', "stop[0]"),
    ("/tokenize", b'{"model": "toy", "prompt": "a\\ud800"}', "prompt"),
    ("/tokenize", b'{"model": "toy", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/completions", b'{"model": "toy", "prompt": "ok", "x\\ud800": 1}', "x\\ud800"),
])
def test_lone_surrogates_are_refused_with_their_field(deployment: Deployment, path: str,
                                                      body: bytes, param: str) -> None:
    assert_refused(post_raw(deployment, path, body), param)


def test_a_user_with_a_lone_surrogate_is_refused_before_routing(deployment: Deployment) -> None:
    body = b'{"model": "toy", "prompt": "abc", "max_tokens": 3, "user": "\\ud800"}'
    assert_refused(post_raw(deployment, "/v1/completions", body), "user")
    paired = b'{"model": "toy", "prompt": "abc", "max_tokens": 3, "user": "\\ud83d\\ude00"}'
    assert post_raw(deployment, "/v1/completions", paired).status_code == 200


@pytest.mark.parametrize(("depth", "param"), [(65, "prompt"), (2000, "body")])
def test_deep_nesting_is_refused(deployment: Deployment, depth: int, param: str) -> None:
    # 2000 levels pass the interpreter's recursion limit inside json.loads itself.
    body = b'{"model": "toy", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    r = post_raw(deployment, "/v1/completions", body)
    assert_refused(r, param)
    assert r.json()["error"]["code"] == "too_deep"


@pytest.mark.parametrize(("field", "literal"), [
    ("temperature", b"1" + b"0" * 400),
    ("top_p", b"1e400"),
    ("presence_penalty", b"-1e400"),
    ("repetition_penalty", b"NaN"),
    ("temperature", b"Infinity"),
    ("frequency_penalty", b"-Infinity"),
    ("top_k", b"9" * 30),
    ("seed", b"-" + b"9" * 20),
])
def test_huge_and_non_finite_numbers_name_the_field(deployment: Deployment, field: str,
                                                    literal: bytes) -> None:
    body = b'{"model": "toy", "prompt": "abc", "%s": %s}' % (field.encode(), literal)
    assert_refused(post_raw(deployment, "/v1/completions", body), field)


@pytest.mark.parametrize("body", [
    {**CHAT, "max_completion_tokens": 0},
    {**CHAT, "max_tokens": None, "max_completion_tokens": 0},
    {**CHAT, "max_tokens": 3, "max_completion_tokens": -1},
])
def test_max_completion_tokens_follows_the_max_tokens_rule(deployment: Deployment,
                                                           body: dict[str, Any]) -> None:
    assert_refused(call(deployment, "POST", "/v1/chat/completions", json=body),
                   "max_completion_tokens")


@pytest.mark.parametrize(("body", "param"), [
    ({**GOOD, "top_k": 2**40}, "top_k"),
    ({**GOOD, "top_k": 2**31}, "top_k"),
    ({**GOOD, "seed": -1}, "seed"),
    ({**GOOD, "seed": 2**32 - 1}, "seed"),  # llama.cpp's "random seed"
    ({**GOOD, "seed": 2**32 - 2, "n": 2}, "seed"),  # the second choice draws with seed + 1
    ({**GOOD, "seed": 2**63}, "seed"),
    ({**GOOD, "max_tokens": 2**31}, "max_tokens"),
    ({**GOOD, "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({**GOOD, "n": 2**62}, "n"),
    ({**GOOD, "logprobs": -1}, "logprobs"),
    ({**GOOD, "priority": 2**31}, "priority"),
    ({**GOOD, "priority": "high"}, "priority"),
])
def test_integer_fields_are_bounded(deployment: Deployment, body: dict[str, Any],
                                    param: str) -> None:
    assert_refused(call(deployment, "POST", "/v1/completions", json=body), param)


def test_integer_fields_at_their_bounds_are_served(deployment: Deployment) -> None:
    for extra in ({"top_k": 2**31 - 1}, {"seed": 2**32 - 2}, {"seed": 0},
                  {"seed": 2**32 - 3, "n": 2}, {"top_k": -1}, {"priority": -2**31},
                  {"priority": 2**31 - 1}):
        r = call(deployment, "POST", "/v1/completions", json={**GOOD, **extra})
        assert r.status_code == 200, (extra, r.text)
