"""POST /v1/responses with the official openai client, against a real server of the
embedded model: create, stream, max_output_tokens, text.format, function tools, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest
from conftest import ServerProcess

INSTRUCTIONS = "You are terse."
QUESTION = "Name three colours."


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


def test_a_string_input_answers_with_a_message_and_usage(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=200,
                                temperature=0, metadata={"run": "1"}, store=False)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "completed" and r.incomplete_details is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and r.output_text
    assert r.metadata == {"run": "1"} and r.store is False and r.previous_response_id is None
    assert r.usage is not None and r.usage.input_tokens > 5
    assert 0 < r.usage.output_tokens <= 200
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_greedy_text_is_chat_completions_text(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    r = client.responses.create(
        model="smollm2", instructions=INSTRUCTIONS, max_output_tokens=24, temperature=0,
        input=[{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="Tell me a long story.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    events = list(client.responses.create(model="smollm2", input="Tell me a long story.",
                                          max_output_tokens=3, temperature=0, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete"  # as OpenAI ends a cut stream
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == r.output_text


def test_stream_sends_the_documented_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24,
                                    temperature=0)
    events = list(client.responses.create(model="smollm2", input=QUESTION,
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    done = events[-1].response
    assert done.output_text == text and done.usage is not None
    assert done.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_stream_helper_gives_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="smollm2", input=QUESTION, max_output_tokens=200,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and final.status == "completed"


class Colour(pydantic.BaseModel):
    name: str
    hex: str


def test_json_schema_format_gives_parseable_json(client: openai.OpenAI) -> None:
    r = client.responses.parse(model="smollm2", input="Give me a colour as JSON.",
                               text_format=Colour, max_output_tokens=200, temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Colour)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    plain = client.responses.create(
        model="smollm2", input="A colour as JSON.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert isinstance(json.loads(plain.output_text)["name"], str)
    loose = client.responses.create(model="smollm2", input="A colour as JSON.",
                                    max_output_tokens=8, temperature=0,
                                    text={"format": {"type": "json_object"}})
    assert loose.output_text.startswith("{")


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


def test_a_forced_function_call_and_its_output(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120,
        temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str) and calls[0].call_id
    follow = client.responses.create(
        model="smollm2", tools=[WEATHER], max_output_tokens=20, temperature=0,  # type: ignore[list-item]
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model="smollm2", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        parallel_tool_calls=False, max_output_tokens=120, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"]
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == done[0].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"]


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"encrypted": True}}, "reasoning.encrypted"),
    ({"input": 5}, "input"),
])
def test_what_is_not_implemented_is_a_400_naming_it(smollm_server: ServerProcess,
                                                     body: dict[str, object],
                                                     param: str) -> None:
    r = httpx.post(f"{smollm_server.url}/v1/responses",
                   json={"model": "smollm2", "input": "Hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unknown_ids_are_a_404_naming_them(smollm_server: ServerProcess) -> None:
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{smollm_server.url}/v1/responses/resp_abc", timeout=30)
        assert r.status_code == 404 and "resp_abc" in r.json()["error"]["message"]
    r = httpx.post(f"{smollm_server.url}/v1/responses", timeout=30, json={
        "model": "smollm2", "input": "Hi", "previous_response_id": "resp_gone"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "previous_response_id"
    assert "resp_gone" in r.json()["error"]["message"]


def test_stored_responses_are_got_continued_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model="smollm2", input=QUESTION, instructions=INSTRUCTIONS,
                                    max_output_tokens=16, temperature=0)
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    follow = client.responses.create(model="smollm2", input="And three more?",
                                     previous_response_id=first.id, instructions=INSTRUCTIONS,
                                     max_output_tokens=16, temperature=0)
    assert follow.previous_response_id == first.id
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "And three more?"}])
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unkept = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2,
                                     store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_streamed_response_is_stored_too(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="smollm2", input=QUESTION,
                                          max_output_tokens=8, temperature=0, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_input_items_list_a_stored_responses_own_input(client: openai.OpenAI,
                                                       smollm_server: ServerProcess) -> None:
    single = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=4,
                                     temperature=0)
    (item,) = client.responses.input_items.list(single.id).data
    assert item.type == "message" and item.role == "user" and item.id
    assert [(p.type, p.text) for p in item.content] == [("input_text", QUESTION)]

    items = [{"type": "message", "role": "user", "content": "What is the weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}', "id": "fc_given"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    tools = [{"type": "function", "name": "get_weather", "description": "The weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    follow = client.responses.create(model="smollm2", input=items, tools=tools,
                                     max_output_tokens=8, temperature=0,
                                     previous_response_id=single.id)
    listed = client.responses.input_items.list(follow.id)  # newest first, as OpenAI lists
    assert [i.type for i in listed.data] == ["function_call_output", "function_call",
                                             "message"]  # its own input, not the previous
    assert listed.data[1].id == "fc_given" and listed.data[0].output == "sunny"
    ascending = client.responses.input_items.list(follow.id, order="asc", limit=2)
    assert [i.type for i in ascending.data] == ["message", "function_call"]
    assert ascending.has_more and ascending.last_id == "fc_given"
    rest = client.responses.input_items.list(follow.id, order="asc", after="fc_given")
    assert [i.type for i in rest.data] == ["function_call_output"] and not rest.has_more

    url = f"{smollm_server.url}/v1/responses"
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")):
        r = httpx.get(f"{url}/{follow.id}/input_items?{query}", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(f"{url}/resp_gone/input_items", timeout=30)
    assert r.status_code == 404 and "resp_gone" in r.json()["error"]["message"]
