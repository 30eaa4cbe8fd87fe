"""The stored responses of POST /v1/responses (``store``, the default): kept in memory for
``GET``, ``DELETE``, ``input_items`` and ``previous_response_id``, and bounded.

Each is kept as one compact JSON text (its response object, its conversation and its input
items), so what the store holds is what it counts: at most :data:`MAX_RESPONSES` responses
and :data:`MAX_BYTES` bytes of text, oldest dropped first (a ``previous_response_id`` that
old is a 404 like an unknown one). :func:`planned_bytes` is its line in the memory plan.
The store is the server process's and does not survive a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import attrs

MAX_RESPONSES = 1024
MAX_BYTES = 16 * 2**20
# A kept response besides its text: the bytes object's header and the ordered dict's entry
# and key (measured: about 180 B with a 33-character id; rounded up).
ENTRY_BYTES = 256


def planned_bytes(max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> int:
    """The most the store can hold: its text and its entries (with the defaults, the memory
    plan's ``RESPONSE_STORE_BYTES``)."""
    return max_bytes + max_responses * ENTRY_BYTES


@attrs.frozen
class Stored:
    """A response object, and its conversation as chat messages (its input after any
    previous response's, and its output), without its instructions, as OpenAI continues;
    and its own input items, for ``GET /v1/responses/{id}/input_items``."""

    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    input_items: tuple[dict[str, Any], ...] = ()


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0  # the text held

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> Stored | None:
        data = self._items.get(response_id)
        if data is None:
            return None
        response, conversation, items = json.loads(data)
        return Stored(response, tuple(conversation), tuple(items))

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: tuple[dict[str, Any], ...] = ()) -> None:
        data = json.dumps([response, conversation, input_items], separators=(",", ":"),
                          ensure_ascii=False).encode()
        self.delete(response["id"])
        if len(data) > self.max_bytes:
            return  # larger than the whole store: not kept
        self._items[response["id"]] = data
        self.bytes += len(data)
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= len(old)
        return old is not None


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant message a chat conversation holds."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls
                               else None}
    if calls:
        message["tool_calls"] = calls
    return [message]
