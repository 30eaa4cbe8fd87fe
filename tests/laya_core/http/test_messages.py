"""Anthropic's Messages API in-process on the toy backend (which repeats its prompt): the
message and event shapes, stop reasons, count_tokens, keys and Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_http_errors import KEY
from toy_backend import toy_deployment

from laya_core.http import create_app
from laya_core.http.anthropic_format import matched_stop
from laya_core.http.anthropic_requests import parse_messages
from laya_core.http.errors import APIError
from laya_core.serving.deployment import Deployment

HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = toy_deployment(tmp_path_factory.mktemp("toy"),
                       [{"name": "toy", "max_seq_len": 256, "max_num_seqs": 2}],
                       server={"api_keys": [KEY]})
    d.start()
    assert d.wait_ready(10)
    yield d
    d.stop()


def post(deployment: Deployment, path: str, body: Any,
         headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json=body,
                                     headers={"x-api-key": KEY} if headers is None else headers)

    return asyncio.run(go())


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_create_and_stream_agree(deployment: Deployment) -> None:
    body = {"model": "toy", "max_tokens": 12, "messages": HI, "system": "Be brief."}
    r = post(deployment, "/v1/messages", body)
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["model"] == "toy"
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    (block,) = message["content"]
    assert block["type"] == "text" and len(block["text"]) == 12
    assert message["usage"]["output_tokens"] == 12
    counted = post(deployment, "/v1/messages/count_tokens",
                   {"model": "toy", "messages": HI, "system": "Be brief."}).json()
    u = message["usage"]
    assert counted["input_tokens"] == u["input_tokens"] + u["cache_read_input_tokens"]

    r = post(deployment, "/v1/messages", {**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    seq = events(r.text)
    names = [name for name, _ in seq]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in seq if n == "content_block_delta")
    assert text == block["text"]
    start = seq[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = seq[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12


def test_stop_sequences(deployment: Deployment) -> None:
    # The toy repeats its prompt: the user's text comes back, and with it the stop sequence.
    body = {"model": "toy", "max_tokens": 150, "messages": HI, "stop_sequences": ["there"]}
    message = post(deployment, "/v1/messages", body).json()
    assert message.get("stop_reason") == "stop_sequence", message
    assert message["stop_sequence"] == "there"
    assert "there" not in message["content"][0]["text"]
    seq = events(post(deployment, "/v1/messages", {**body, "stream": True}).text)
    assert seq[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "there"}


def test_errors_in_anthropic_shape(deployment: Deployment) -> None:
    url = "/v1/messages"
    assert "max_tokens" in error_of(post(deployment, url, {"model": "toy", "messages": HI}),
                                    400, "invalid_request_error")
    image = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]
    message = error_of(post(deployment, url, {"model": "toy", "max_tokens": 4,
                                              "messages": image}), 400, "invalid_request_error")
    assert message.startswith("messages[0].content[1]") and "text-only" in message
    for field, value in (("thinking", {"type": "sometimes"}), ("top_logprobs", 3),
                         ("thinking", {"type": "enabled", "budget_tokens": 0}),
                         ("mcp_servers", [])):
        message = error_of(post(deployment, url, {"model": "toy", "max_tokens": 4,
                                                  "messages": HI, field: value}),
                           400, "invalid_request_error")
        assert message.startswith(field), message
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}):
        assert post(deployment, url, {"model": "toy", "max_tokens": 4, "messages": HI,
                                      "thinking": thinking}).status_code == 200  # no reasoning
    message = error_of(post(deployment, url, {"model": "toy", "max_tokens": 4, "messages": HI,
                                              "stop_sequences": [""]}),
                       400, "invalid_request_error")
    assert message.startswith("stop_sequences"), message
    # A final assistant message is a prefill the answer continues: its text ends the
    # prompt (the toy's tokens are bytes), and only the continuation comes back.
    prefill = [*HI, {"role": "assistant", "content": "Sure"}]
    r = post(deployment, url, {"model": "toy", "max_tokens": 4, "messages": prefill})
    assert r.status_code == 200, r.text
    count = url.replace("/v1/messages", "/v1/messages/count_tokens")
    with_prefill = post(deployment, count, {"model": "toy", "messages": prefill}).json()
    without = post(deployment, count, {"model": "toy", "messages": HI}).json()
    assert with_prefill["input_tokens"] > without["input_tokens"]
    usage = r.json()["usage"]  # input_tokens: those not read from the prefix cache
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] \
        == with_prefill["input_tokens"]
    message = error_of(post(deployment, url, {"model": "toy", "max_tokens": 4, "messages": [
        *HI, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}),
        400, "invalid_request_error")
    assert message.startswith("messages[1].content"), message
    assert "model" in error_of(post(deployment, url, {"model": "nope", "max_tokens": 4,
                                                      "messages": HI}), 404, "not_found_error")
    for body in (None, [], {"model": "toy", "max_tokens": 4, "messages": [{"role": "x"}]},
                 {"model": "toy", "max_tokens": 4, "messages": HI, "temperature": 1.5},
                 {"model": "toy", "max_tokens": 4, "messages": HI, "tools": [{"name": "f"}]},
                 {"model": "toy", "max_tokens": 4, "messages": HI, "tool_choice": {"type": "x"}},
                 {"model": "toy", "max_tokens": True, "messages": HI}):
        error_of(post(deployment, url, body), 400, "invalid_request_error")
    error_of(post(deployment, "/v1/messages/count_tokens", {"model": "toy", "messages": HI,
                                                            "max_tokens": 4}),
             400, "invalid_request_error")


def test_keys(deployment: Deployment) -> None:
    body = {"model": "toy", "max_tokens": 2, "messages": HI}
    for headers in ({}, {"x-api-key": "sk-wrong-0123456789"},
                    {"Authorization": "Bearer sk-wrong-0123456789"}):
        error_of(post(deployment, "/v1/messages", body, headers), 401, "authentication_error")
    assert post(deployment, "/v1/messages", body,
                {"Authorization": f"Bearer {KEY}"}).status_code == 200
    # x-api-key is a key wherever keys are asked for; other paths keep OpenAI's error shape.
    assert post(deployment, "/v1/chat/completions", body).status_code == 200
    r = post(deployment, "/v1/chat/completions", body, {})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_translation_of_blocks_and_tools() -> None:
    req = parse_messages({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Sys."}],
        "tools": [{"name": "get", "description": "Get it.",
                   "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Find x."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"q": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "not found"}]},
                {"type": "text", "text": "Try again."}]}]})
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"q": "x"}
    assert req.messages[3] == {"role": "tool", "tool_call_id": "toolu_1",
                               "content": "Error: not found"}
    assert req.tools is not None and req.tools.choice == "get" and not req.tools.parallel
    with pytest.raises(APIError) as e:
        parse_messages({"model": "m", "max_tokens": 5, "messages": HI,
                        "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]})
    assert e.value.param == "tools[0].name"


def test_matched_stop() -> None:
    def token_bytes(t: int) -> bytes:
        return bytes([t])

    ids = list(b"Hello. World")
    assert matched_stop("Hello", ids, token_bytes, ["!", "."]) == "."
    assert matched_stop("Hello. World", ids, token_bytes, ["."]) is None
    assert matched_stop("Hello", ids, token_bytes, []) is None
