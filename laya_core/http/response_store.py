"""The stored responses of POST /v1/responses (``store``, the default): kept in memory for
``GET``, ``DELETE`` and ``previous_response_id``, and bounded.

Bounded by count (:data:`MAX_RESPONSES`) and by size (:data:`MAX_CHARS`, the characters of
the responses and conversations held); past either, the oldest are dropped first, so a
``previous_response_id`` that old is a 404 like an unknown one. The store is the server
process's, not in the memory plan, and does not survive a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import attrs

MAX_RESPONSES = 1024
MAX_CHARS = 64 * 2**20


@attrs.frozen
class Stored:
    """A response object, and its conversation as chat messages (its input after any
    previous response's, and its output), without its instructions, as OpenAI continues;
    and its own input items, for ``GET /v1/responses/{id}/input_items``."""

    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    chars: int
    input_items: tuple[dict[str, Any], ...] = ()


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: tuple[dict[str, Any], ...] = ()) -> None:
        chars = len(json.dumps(response)) + len(json.dumps(conversation)) \
            + len(json.dumps(input_items))
        if chars > self.max_chars:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self._items[response["id"]] = Stored(response, tuple(conversation), chars,
                                             input_items)
        self.chars += chars
        while len(self._items) > self.max_responses or self.chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self.chars -= old.chars

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.chars -= old.chars
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
