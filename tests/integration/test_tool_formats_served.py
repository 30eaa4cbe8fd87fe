"""Each family's tool-call format through a real server: copies of the embedded model whose
``tokenizer.chat_template`` is that family's published template (tests/chat_templates),
a forced call (``tool_choice`` required, which the grammar writes in the family's format,
since the small model knows none of them), and the call back as an OpenAI tool call,
streamed and not. The format logic is the front end's, so one backend serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess, serving
from hostile_gguf import FAMILY_CONTROLS, embedded, with_metadata, with_tokens

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
FAMILIES = ("llama3_json", "mistral", "mistral_args", "qwen3_coder", "harmony")
# Copies whose vocabulary has the family's markup as control tokens, as the family's own
# has (hostile_gguf.FAMILY_CONTROLS): the grammar must write the tokens, and the output
# show them to the parser, which keeps them from the client.
CONTROL_COPIES = ("mistral_args-controls", "harmony-controls")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# How each family's call begins, as the grammar writes it, blanks left out.
OPENINGS = {"llama3_json": '{"name":"get_weather","parameters":',
            "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":',
            "mistral_args": "[TOOL_CALLS]get_weather[ARGS]",
            "qwen3_coder": "<tool_call>\n<function=get_weather>\n",
            "harmony": "<|channel|>commentaryto=functions.get_weather<|constrain|>json"}


@pytest.fixture(scope="module", params=FRONT_END_BACKENDS)
def family_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server with a model per family, each the embedded model under that family's
    chat template."""
    tmp = tmp_path_factory.mktemp(f"tool_formats_{request.param}")
    text = '[server]\nhost = "127.0.0.1"\nport = {port}\n'
    for name in FAMILIES + CONTROL_COPIES:
        family = name.removesuffix("-controls")
        path = with_metadata(embedded(), tmp / f"{name}.gguf", "tokenizer.chat_template",
                             (TEMPLATES / f"{family}.jinja").read_text(), "str")
        if name != family:
            path = with_tokens(path, tmp / f"{name}-tokens.gguf", FAMILY_CONTROLS)
        text += (f'\n[[models]]\nname = "{name}"\nbackend = "{request.param}"\n'
                 f'path = "{path}"\nmax_seq_len = 1024\nmax_num_seqs = 1\n')
    with serving(text, tmp) as server:
        yield server


def chat(server: ServerProcess, family: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": family, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 100, "temperature": 0, **fields})


def streamed(server: ServerProcess, family: str) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls (name, arguments joined) and finish reason of a streamed reply."""
    content, finish = "", ""
    calls: dict[int, list[str]] = {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": family, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 100, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                if "id" in call:
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [(name, args) for name, args in calls.values()], finish


@pytest.mark.parametrize("family", FAMILIES + CONTROL_COPIES)
def test_a_forced_call_comes_back_parsed_in_each_family_format(
        family_server: ServerProcess, family: str) -> None:
    r = chat(family_server, family)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None, message  # the raw format never reaches the client
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    content, calls, finish = streamed(family_server, family)
    assert (content, calls, finish) == \
        ("", [("get_weather", call["function"]["arguments"])], "tool_calls")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_cut_in_its_name_shows_the_family_format(
        family_server: ServerProcess, family: str) -> None:
    """Cut inside its name, a call is the text generated: the family's own opening."""
    r = chat(family_server, family, max_tokens=6)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    text = choice["message"]["content"]
    assert text and OPENINGS[family].startswith(text.replace(" ", "")), text


def test_responses_and_messages_read_a_family_call_too(family_server: ServerProcess) -> None:
    """The Responses and Anthropic Messages APIs share chat's parser: a Qwen3-Coder XML
    call comes back as a function_call item and a tool_use block."""
    fn = WEATHER["function"]
    r = httpx.post(f"{family_server.url}/v1/responses", timeout=120, json={
        "model": "qwen3_coder", "input": ASK[0]["content"], "max_output_tokens": 100,
        "tools": [{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}],
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0})
    assert r.status_code == 200, r.text
    (item,) = r.json()["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather", item
    assert set(json.loads(item["arguments"])) == {"city"}
    r = httpx.post(f"{family_server.url}/v1/messages", timeout=120, json={
        "model": "qwen3_coder", "max_tokens": 100, "messages": ASK,
        "tools": [{"name": fn["name"], "input_schema": fn["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_reason"] == "tool_use", body
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather", block
    assert set(block["input"]) == {"city"}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_conversation_goes_on_after_a_family_call(family_server: ServerProcess,
                                                      family: str) -> None:
    """The call and its result go back through the family's template, with the call id
    the server gave (Mistral's templates demand 9 letters or digits)."""
    (call,) = chat(family_server, family).json()["choices"][0]["message"]["tool_calls"]
    if family.startswith("mistral"):
        assert len(call["id"]) == 9 and call["id"].isalnum(), call["id"]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'}]
    r = chat(family_server, family, messages=messages, tool_choice="auto", max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_leaves_the_text_to_the_model(family_server: ServerProcess,
                                           family: str) -> None:
    """With tool_choice auto each family's grammar (free text up to its trigger) compiles
    against the real vocabulary, and what the model writes comes back as text or calls."""
    r = chat(family_server, family, tool_choice="auto", max_tokens=8)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls")
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop") or \
        choice["finish_reason"] == "length", choice  # the small model may say nothing
