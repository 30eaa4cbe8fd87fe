"""The official anthropic client against a real server of the embedded model: Anthropic's
Messages API (/v1/messages) runs on the chat path, so its greedy text is chat's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import FRONT_END_BACKENDS, SMOLLM_MANIFEST, ServerProcess, serving

MESSAGES: list[anthropic.types.MessageParam] = [
    {"role": "user", "content": "Name three colours."}]
SYSTEM = "You are a helpful assistant."
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}
KEY = "sk-test-0123456789"
GREEDY = {"temperature": 0}  # a field today's SDK no longer types, still Anthropic's


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=smollm_server.url, api_key="unused",
                             max_retries=0) as client:
        yield client


def test_create_equals_chat_completions_greedy(smollm_server: ServerProcess,
                                               client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="smollm2", system=SYSTEM, messages=MESSAGES,
                               max_tokens=24, extra_body=GREEDY)
    assert m.role == "assistant" and m.type == "message" and m.model == "smollm2"
    assert m.stop_reason in ("end_turn", "max_tokens")
    (block,) = m.content
    assert block.type == "text" and block.text
    assert 0 < m.usage.output_tokens <= 24
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0) as chat:
        r = chat.chat.completions.create(
            model="smollm2", max_tokens=24, extra_body=GREEDY,
            messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])  # type: ignore[list-item]
    assert r.choices[0].message.content == block.text
    assert r.usage is not None and r.usage.prompt_tokens == \
        m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    counted = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == r.usage.prompt_tokens


def test_a_prefill_is_continued_as_chat_continues_a_final_message(
        smollm_server: ServerProcess, client: anthropic.Anthropic) -> None:
    """A final assistant message is the start of the answer: the model continues it, and
    the reply holds only what it wrote after it; chat completions' continue_final_message
    (vLLM's) is the same request."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "The three colours are"}]
    m = client.messages.create(model="smollm2", messages=prefill,  # type: ignore[arg-type]
                               max_tokens=12, extra_body=GREEDY)
    (block,) = m.content
    assert block.text and not block.text.startswith("The three colours are")
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0) as chat:
        r = chat.chat.completions.create(
            model="smollm2", max_tokens=12, messages=prefill,  # type: ignore[arg-type]
            extra_body={**GREEDY, "continue_final_message": True})
        assert r.choices[0].message.content == block.text
        plain = chat.chat.completions.create(model="smollm2", max_tokens=12,
                                             messages=MESSAGES,  # type: ignore[arg-type]
                                             extra_body=GREEDY)
        assert plain.usage is not None and r.usage is not None
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as bad:  # nothing to continue
            chat.chat.completions.create(model="smollm2", max_tokens=4, messages=MESSAGES,
                                         extra_body={"continue_final_message": True})
        assert bad.value.body["param"] == "continue_final_message"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:  # a format starts the turn
            chat.chat.completions.create(model="smollm2", max_tokens=4, messages=prefill,
                                         response_format={"type": "json_object"},
                                         extra_body={"continue_final_message": True})
        assert bad.value.body["param"] == "continue_final_message"  # type: ignore[index]
    counted = client.messages.count_tokens(model="smollm2", messages=prefill)  # type: ignore[arg-type]
    assert counted.input_tokens == r.usage.prompt_tokens


def test_stream_events_and_final_message(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                   extra_body=GREEDY)
    with client.messages.stream(model="smollm2", messages=MESSAGES, max_tokens=24,
                                extra_body=GREEDY) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the helper's own events, beside the raw
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text"
    assert final.content[0].text == "".join(deltas) == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                   extra_body=GREEDY)
    text = whole.content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) > 2, text
    stop = words[len(words) // 2]
    cut = client.messages.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                 extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]
    short = client.messages.create(model="smollm2", messages=MESSAGES, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_tools(client: anthropic.Anthropic) -> None:
    asked: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model="smollm2", messages=asked, max_tokens=80, extra_body=GREEDY,
                               tools=[WEATHER], tool_choice=ONE_CALL)  # type: ignore[list-item]
    assert m.stop_reason == "tool_use", m.content
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and "city" in call.input
    counted = client.messages.count_tokens(model="smollm2", messages=asked, tools=[WEATHER],  # type: ignore[list-item]
                                           tool_choice=ONE_CALL)  # type: ignore[arg-type]
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    plain = client.messages.create(model="smollm2", messages=asked, max_tokens=16,
                                   extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
                                   tool_choice={"type": "none"})
    assert plain.stop_reason != "tool_use" and all(b.type == "text" for b in plain.content)
    with client.messages.stream(model="smollm2", messages=asked, max_tokens=80, extra_body=GREEDY,
                                tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice=ONE_CALL) as stream:
        partial = [e.delta.partial_json for e in stream
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert partial and final.stop_reason == "tool_use"
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert streamed.input == call.input and streamed.name == call.name
    answered = client.messages.create(
        model="smollm2", max_tokens=16, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        messages=[*asked, {"role": "assistant", "content": m.content},  # type: ignore[typeddict-item]
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 21 C"}]}])
    assert answered.content and answered.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_errors_in_anthropic_shape(smollm_server: ServerProcess,
                                   client: anthropic.Anthropic) -> None:
    r = httpx.post(f"{smollm_server.url}/v1/messages",
                   json={"model": "smollm2", "messages": MESSAGES})
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "text-only" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def keyed_server(workdir: Path) -> contextlib.AbstractContextManager[ServerProcess]:
    manifest = SMOLLM_MANIFEST.replace("[server]\n", f'[server]\napi_keys = ["{KEY}"]\n')
    manifest = manifest.replace('backend = "llamacpp"', f'backend = "{FRONT_END_BACKENDS[0]}"')
    return serving(manifest, workdir, api_key=KEY)


def test_x_api_key(tmp_path: Path) -> None:
    with keyed_server(tmp_path) as server:
        with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as good:
            m = good.messages.create(model="smollm2", messages=MESSAGES, max_tokens=2)
            assert m.usage.output_tokens == 2
        with anthropic.Anthropic(base_url=server.url, api_key="sk-wrong-0123456789",
                                 max_retries=0) as bad, \
                pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="smollm2", messages=MESSAGES, max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0) as bearer:
            assert bearer.messages.count_tokens(model="smollm2",
                                                messages=MESSAGES).input_tokens > 0
