"""A Responses API body becomes the chat request it means; what is not implemented is a 400
naming the Responses field."""

from __future__ import annotations

from typing import Any

import pytest

from laya_core.http.errors import APIError
from laya_core.http.response_store import ResponseStore, output_messages, planned_bytes
from laya_core.http.responses_format import parse_responses


def _parse(**body: Any) -> Any:
    return parse_responses({"model": "m", "input": "Hi", **body})


def test_a_string_and_instructions_become_messages() -> None:
    req = _parse(instructions="Be brief.", max_output_tokens=7, temperature=0.5,
                 metadata={"k": "v"}, store=True)
    assert req.chat.messages == ({"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"})
    assert req.chat.common.max_tokens == 7 and req.chat.common.temperature == 0.5
    assert req.chat.common.max_tokens_param == "max_output_tokens"
    assert req.echo["metadata"] == {"k": "v"} and req.chat.tools is None


def test_items_become_a_tool_conversation() -> None:
    req = _parse(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ], tools=[{"type": "function", "name": "w"}], tool_choice={"type": "function", "name": "w"})
    user, calls, output = req.chat.messages
    assert user == {"role": "user", "content": "Weather?"}
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]
    assert output == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert req.chat.tools is not None and req.chat.tools.choice == "w"


def test_text_format_is_the_chat_constraint() -> None:
    req = _parse(text={"format": {"type": "json_schema", "name": "x",
                                  "schema": {"type": "object"}}})
    assert req.chat.common.constraint is not None
    assert _parse(text={"format": {"type": "text"}}).chat.common.constraint is None


@pytest.mark.parametrize(("body", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        _parse(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_previous_conversation_comes_before_the_input_without_its_instructions() -> None:
    history = ({"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"})
    req = parse_responses({"model": "m", "input": "Two?", "instructions": "New."}, history)
    assert req.chat.messages[0] == {"role": "system", "content": "New."}
    assert req.chat.messages[1:3] == history
    assert req.conversation == (*history, {"role": "user", "content": "Two?"})


def test_the_store_keeps_the_newest_within_its_bounds() -> None:
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2
    store.put({"id": "big", "output": []}, [{"role": "user", "content": "x" * 9_000}])
    assert store.get("big") and store.get("r1") is None and store.bytes <= 10_000
    store.put({"id": "huge", "output": []}, [{"role": "user", "content": "x" * 20_000}])
    assert store.get("huge") is None  # larger than the store: not kept
    assert store.delete("big") and not store.delete("big") and store.bytes <= 10_000
    # Counted in UTF-8 bytes, as held: two bytes a character here.
    store.put({"id": "é", "output": []}, [{"role": "user", "content": "é" * 4_000}])
    assert store.bytes > 8_000 and store.get("é").conversation[0]["content"] == "é" * 4_000


def test_a_stored_response_comes_back_as_it_went_in() -> None:
    store = ResponseStore()
    response = {"id": "r", "output": [{"type": "message", "content": []}], "metadata": {"k": 1}}
    items = ({"type": "message", "role": "user", "id": "msg_1",
              "content": [{"type": "input_text", "text": "hi"}]},)
    store.put(response, [{"role": "user", "content": "hi"}], items)
    got = store.get("r")
    assert got is not None and got.response == response and got.input_items == items
    assert got.conversation == ({"role": "user", "content": "hi"},)


def test_the_stores_plan_line_bounds_what_it_can_hold() -> None:
    import sys

    store = ResponseStore(max_responses=64, max_bytes=64 * 1024)
    for i in range(200):
        store.put({"id": f"resp_{i:032d}", "output": []},
                  [{"role": "user", "content": "x" * 900}])
    held = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in store._items.items())
    held += sys.getsizeof(store._items)
    assert len(store) == 64 and held <= planned_bytes(64, 64 * 1024)
    from laya_core.memory.ledger import RESPONSE_STORE_BYTES

    assert planned_bytes() == RESPONSE_STORE_BYTES  # the memory plan counts the store


def test_output_items_become_one_assistant_message() -> None:
    output = [{"type": "message", "content": [{"type": "output_text", "text": "Hm."}]},
              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    (message,) = output_messages(output)
    assert message["content"] == "Hm." and message["tool_calls"][0]["id"] == "c"
