"""Structured output and tool calls through a real server of the embedded model, with the
official openai client, on each backend (the session's ``smollm_server``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import ServerProcess

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 40}},
                   "required": ["city"]}, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "current_time",
                                          "description": "The time now"}}  # no parameters
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int
    hobbies: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        yield client


def chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    """The reply's text and finish reason, streamed or not."""
    args = {"model": "smollm2", "messages": ASK, "max_tokens": 120, **kwargs}
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model="smollm2", messages=ASK,  # type: ignore[arg-type]
                                      response_format=Person, max_tokens=150, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_greedy_and_sampled(client: openai.OpenAI,
                                                         stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    # The schema bounds its strings: 130 characters, each at most 4 bytes, a token at
    # most one byte, plus the structure. A sampled reply may fill its strings with 3-byte
    # characters (this model at temperature 1), which 150 tokens did not hold; 640 do.
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        text, finish = chat(client, stream, response_format=fmt, temperature=temperature,
                            seed=seed, max_tokens=640)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_always_an_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        text, finish = chat(client, seed % 2 == 1, response_format={"type": "json_object"},
                            temperature=1.0, seed=seed, max_tokens=80)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still an object's beginning
            assert finish == "length" and text.startswith("{")


def test_whitespace_cannot_run_away(client: openai.OpenAI) -> None:
    """At temperature 2 a small model samples nearly anything the mask allows; the runs of
    blanks stay within the bound (two spaces, or a line break and 32 spaces)."""
    for seed in range(2):
        text, _ = chat(client, False, temperature=2.0, seed=seed, max_tokens=60,
                       extra_body={"guided_json": PERSON})
        runs = re.findall(r"[ \t\r\n]+", text)
        assert all(len(r) <= 33 and r.count("\n") <= 1 for r in runs), text


def test_length_cut_is_reported(client: openai.OpenAI) -> None:
    text, finish = chat(client, False, response_format={"type": "json_object"},
                        temperature=0, max_tokens=3)
    assert finish == "length" and text.startswith("{")


def test_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    text, _ = chat(client, False, temperature=1.0, seed=3, max_tokens=20,
                   extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)
    text, _ = chat(client, True, temperature=0, max_tokens=5,
                   extra_body={"guided_choice": ["red", "green", "blue"]})
    assert text in ("red", "green", "blue")
    text, _ = chat(client, False, temperature=1.0, seed=4, max_tokens=20,
                   extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'})
    assert re.fullmatch(r"yes|no|maybe [0-9]", text)


def test_keywords_that_cannot_be_enforced_are_refused(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
         "uniqueItems"),
        ({"extra_body": {"guided_regex": "(?!x)y"}}, "guided_regex", "look-around"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}],
          "tool_choice": "required"}, "tools", "uniqueItems"),
    ]
    for kwargs, param, word in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=ASK, **kwargs)
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
        assert word in e.value.body["message"]  # type: ignore[index]


def tool_reply(client: openai.OpenAI, stream: bool, **kwargs: Any,
               ) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """The content, the calls (name, arguments) and the finish reason, streamed or not."""
    args = {"model": "smollm2", "messages": WEATHER_ASK, "tools": [WEATHER, CLOCK],
            "max_tokens": 80, "temperature": 0, **kwargs}
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason
    content, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.id is not None:  # the first delta of a call: index, id, type, name
                assert c.type == "function" and c.function and c.function.name
                assert c.index not in calls
                calls[c.index] = {"id": c.id, "name": c.function.name, "arguments": ""}
            assert c.function is not None
            calls[c.index]["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, list(calls.values()), finish


def test_required_tool_calls_validate_streamed_or_not(client: openai.OpenAI) -> None:
    # One call: this small model, allowed more, calls again until max_tokens.
    whole = tool_reply(client, False, tool_choice="required", parallel_tool_calls=False)
    streamed = tool_reply(client, True, tool_choice="required", parallel_tool_calls=False)
    for content, calls, finish in (whole, streamed):
        assert finish == "tool_calls" and calls and not content
        for call in calls:
            args = json.loads(call["arguments"])
            schema = {"get_weather": WEATHER, "current_time": CLOCK}[call["name"]]
            params = schema["function"].get("parameters", {"type": "object",  # type: ignore[attr-defined]
                                                           "additionalProperties": False})
            jsonschema.validate(args, params)
    # Greedy: the concatenated fragments are the non-streamed arguments, exactly.
    assert [(c["name"], c["arguments"]) for c in whole[1]] == \
        [(c["name"], c["arguments"]) for c in streamed[1]]


def test_named_tool_finishes_with_stop_and_one_call(client: openai.OpenAI) -> None:
    for stream in (False, True):
        _, calls, finish = tool_reply(
            client, stream, tool_choice={"type": "function", "function": {"name": "current_time"}})
        assert finish == "stop" and [c["name"] for c in calls] == ["current_time"]
        assert json.loads(calls[0]["arguments"]) == {}  # a tool with no parameters


def test_parallel_tool_calls_false_allows_one(client: openai.OpenAI) -> None:
    for seed in range(2):
        _, calls, finish = tool_reply(client, False, tool_choice="required",
                                      parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert len(calls) <= 1 and (calls or finish == "length")


def test_auto_never_says_tool_calls_without_calls(client: openai.OpenAI) -> None:
    for seed in range(3):
        _, calls, finish = tool_reply(client, seed == 1, tool_choice="auto",
                                            temperature=1.0, seed=seed)
        assert (finish == "tool_calls") == bool(calls) or finish == "length"
        for call in calls:
            json.loads(call["arguments"])  # a call the model starts is constrained


def test_a_multi_turn_history_with_calls_and_results(client: openai.OpenAI,
                                                     smollm_server: ServerProcess) -> None:
    history = [*WEATHER_ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model="smollm2", messages=history,  # type: ignore[arg-type]
                                       tools=[WEATHER], max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The history is rendered with the call and its result in the prompt.
    counted = httpx.post(f"{smollm_server.url}/tokenize", json={
        "model": "smollm2", "messages": WEATHER_ASK}).json()["count"]
    assert r.usage is not None and r.usage.prompt_tokens > counted + 20
