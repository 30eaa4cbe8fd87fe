"""Constrained outputs cut short by ``max_tokens``, and JSON nested inside string fields,
through a real server of the embedded model with the official openai client.

A cut reply keeps what was generated: the text of a response format, a tool call with its
``arguments`` so far, streamed or not, with ``finish_reason`` "length" and every token
counted. Each cut reply is checked against the same request uncut (greedy, on a server
whose greedy output is exactly repeatable): it is a beginning of it. The generated text
itself is read back from the log-probabilities (each token's bytes), so that a reply that
dropped something cannot pass. The parser's rules for a cut call are checked at every cut
and split in tests/laya_core/structured/test_structured_output.py; cutting is the front end's work,
so one backend serves here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import openai
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess, repeatable_server

from laya_core.structured.tools import ToolCallParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 40}},
                   "required": ["city"]}, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "current_time",
                                          "description": "The time now"}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
PERSON_ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"], "additionalProperties": False}
CUTS = (1, 3, 6, 12)


@attrs.frozen
class Reply:
    content: str
    calls: list[tuple[str, str]]  # name, arguments
    finish: str | None
    tokens: tuple[bytes, ...]  # each generated token's bytes, from its log-probabilities
    num_tokens: int  # usage.completion_tokens

    @property
    def generated(self) -> str:
        return b"".join(self.tokens).decode()


@pytest.fixture(scope="module", params=FRONT_END_BACKENDS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with repeatable_server(request.param, tmp_path_factory.mktemp("cut")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=600) as client:
        yield client


def token_bytes(logprobs: Any) -> tuple[bytes, ...]:
    return tuple(bytes(t.bytes) for t in logprobs.content) if logprobs else ()


def reply(client: openai.OpenAI, stream: bool, max_tokens: int, **kwargs: Any) -> Reply:
    args = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, **kwargs}
    if not stream:
        r = client.chat.completions.create(**args)
        m, usage = r.choices[0].message, r.usage
        assert usage is not None
        return Reply(m.content or "", [(c.function.name, c.function.arguments)
                                       for c in m.tool_calls or []],
                     r.choices[0].finish_reason, token_bytes(r.choices[0].logprobs),
                     usage.completion_tokens)
    content, finish, tokens, usage = "", None, (), None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **args):
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            assert c.function is not None
            if c.id is not None:  # a call's first delta: its name, whole
                assert c.index not in calls and c.function.name
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
        tokens += token_bytes(choice.logprobs)
        finish = choice.finish_reason or finish
    assert usage is not None
    return Reply(content, [(n, a) for n, a in calls.values()], finish, tokens,
                 usage.completion_tokens)


def check_cut(cut: Reply, whole: Reply, max_tokens: int) -> None:
    """``cut`` is ``whole`` cut after ``max_tokens`` tokens, with all it generated."""
    assert cut.num_tokens == len(cut.tokens) == max_tokens and cut.finish == "length", cut
    assert whole.generated.startswith(cut.generated), (cut, whole)
    # All that was generated is in the reply, as the parser reads it...
    parser = ToolCallParser()
    content = "".join(v for kind, v in parser.feed(cut.generated) + parser.finish()
                      if kind == "content")
    assert (cut.content, cut.calls) == (content, [
        (c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]), cut
    # ... and a beginning of the uncut reply: earlier calls whole, the last one's arguments
    # so far, text as far as it got.
    assert [n for n, _ in cut.calls] == [n for n, _ in whole.calls[:len(cut.calls)]]
    for (_, got), (_, full) in zip(cut.calls, whole.calls, strict=False):
        assert full.startswith(got), (cut, whole)
    if not cut.calls:
        assert cut.content == cut.generated  # all of it was text so far


TOOL_CHOICES = {
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required": {"tool_choice": "required"},  # calls again and again: the last one is cut
    "auto": {"tool_choice": "auto"},  # this small model answers in text, greedy
}


def cuts_in_calls(whole: Reply) -> list[int]:
    """Token counts that cut each call of ``whole`` just before its name closes, just
    after, and inside its arguments."""
    texts = [b"".join(whole.tokens[:n]).decode(errors="replace")
             for n in range(whole.num_tokens)]

    def first(part: str, times: int) -> int | None:  # tokens until ``part`` shows ``times``
        return next((n for n, t in enumerate(texts) if t.count(part) >= times), None)

    cuts = []
    for i, (name, arguments) in enumerate(whole.calls, start=1):
        closed = first(f'"name": "{name}"', i)
        inside = first(arguments[:6], i) if len(arguments) >= 6 else None
        cuts += [n for n in (closed and closed - 1, closed, inside) if n]
    return cuts


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_a_cut_tool_call_comes_back_as_generated(client: openai.OpenAI, choice: str) -> None:
    """The issue's case: a named tool_choice with max_tokens 6 answered an empty message."""
    kwargs = {"messages": WEATHER_ASK, "tools": [WEATHER, CLOCK], **TOOL_CHOICES[choice]}
    whole = reply(client, False, 64, **kwargs)
    assert bool(whole.calls) == (choice != "auto"), whole
    shapes = set()
    for max_tokens in sorted({*CUTS, *cuts_in_calls(whole)}):
        cut = reply(client, False, max_tokens, **kwargs)
        check_cut(cut, whole, max_tokens)
        assert reply(client, True, max_tokens, **kwargs) == cut
        if not cut.calls:
            shapes.add("text")
        elif len(cut.calls) == 2:
            assert cut.calls[0] == whole.calls[0]  # the first whole, the second so far
            shapes.add("two calls")
        else:
            shapes.add("a call with its arguments so far" if cut.calls[0][1]
                       else "a call, no arguments yet")
    assert shapes == {"named": {"text", "a call, no arguments yet",
                                "a call with its arguments so far"},
                      "required": {"text", "a call, no arguments yet",
                                   "a call with its arguments so far", "two calls"},
                      "auto": {"text"}}[choice]


FORMATS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"extra_body": {"structured_outputs": {
        "regex": r"[A-Z][a-z]+ is [0-9]{2,3} years old\."}}},
    "choice": {"extra_body": {"guided_choice": ["a tall person with red hair",
                                                "a short person"]}},
    "grammar": {"extra_body": {"guided_grammar":
                               'root ::= "Name: " [A-Z] [a-z]+ ", age " [0-9]+ "."'}},
}


@pytest.mark.parametrize("kind", list(FORMATS))
def test_a_cut_response_format_returns_its_beginning(client: openai.OpenAI,
                                                     kind: str) -> None:
    kwargs = {"messages": PERSON_ASK, **FORMATS[kind]}
    whole = reply(client, False, 40, **kwargs)
    assert whole.content == whole.generated, whole
    for max_tokens in (n for n in CUTS if n < whole.num_tokens):
        cut = reply(client, False, max_tokens, **kwargs)
        assert (cut.num_tokens, len(cut.tokens), cut.finish) == (max_tokens, max_tokens,
                                                                 "length"), cut
        assert cut.content == cut.generated and whole.content.startswith(cut.content)
        assert reply(client, True, max_tokens, **kwargs) == cut


def test_a_cut_completion_returns_its_beginning(client: openai.OpenAI) -> None:
    args = {"model": "smollm2", "prompt": "A person, as JSON: ", "temperature": 0,
            "extra_body": {"guided_json": PERSON}}
    whole = client.completions.create(max_tokens=60, **args).choices[0]
    assert whole.finish_reason == "stop"
    for max_tokens in CUTS:
        r = client.completions.create(max_tokens=max_tokens, **args)
        assert r.usage is not None and r.usage.completion_tokens == max_tokens
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text and whole.text.startswith(r.choices[0].text)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            max_tokens=max_tokens, stream=True, **args) if c.choices)
        assert streamed == r.choices[0].text


# Past the interpreter's recursion limit in json.loads. Arguments are the body's rules
# (safe_json); a schema sent as a string is the constraint limits' (structured/precheck).
DEEP = "[" * 5000 + "]" * 5000


def nested(depth: int) -> list[Any]:
    """An array nested ``depth`` deep, as an object in the body (the body's own bound)."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"messages": [*WEATHER_ASK, {"role": "user", "content": "Again?"},
                   {"role": "user", "content": "Please."},
                   {"role": "assistant", "content": None, "tool_calls": [{
                       "id": "call_1", "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": ' + DEEP + "}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
      "tools": [WEATHER]}, "messages[3].tool_calls[0].function.arguments"),
    ({"extra_body": {"guided_json": DEEP}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"json": DEEP}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": DEEP}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"items": nested(70)}}}}}]}, "tools"),
])
def test_deep_nesting_in_a_field_is_a_400_naming_it(client: openai.OpenAI,
                                                    server: ServerProcess,
                                                    kwargs: dict[str, Any], param: str) -> None:
    kwargs = {"messages": PERSON_ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", max_tokens=5, **kwargs)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    assert "nest" in e.value.body["message"]  # type: ignore[index]
    assert "Traceback" not in server.log()
