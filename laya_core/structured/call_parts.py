"""What every tool-call parser shares (Hermes' in ``tools.py``, the other families' in
``tool_parsers.py`` and ``xml_calls.py``): a call as read so far, the list of them, where a
JSON value read a piece at a time closes, and how much of a text's end may still become a
trigger."""

from __future__ import annotations

import uuid
from typing import Any

import attrs


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.define
class Call:
    """One call as its parser has read it so far."""

    index: int
    id: str
    raw: str = ""  # a triggered family's text since its trigger, until the name is complete
    name: str | None = None
    opened: bool = False  # its arguments began
    arguments: list[str] = attrs.field(factory=list)
    done: bool = False  # its arguments closed


class CallList:
    """A parser's calls, as OpenAI's message shape gives them."""

    def __init__(self) -> None:
        self._calls: list[Call] = []

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The calls whose name is complete; a call cut short has the arguments generated so
        far (see :attr:`complete`)."""
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for c in self._calls if c.name is not None]

    @property
    def complete(self) -> bool:
        """Whether every call's arguments closed: no call was cut short."""
        return all(c.done for c in self._calls if c.name is not None)


class JsonEnd:
    """Where a JSON object or array read a piece at a time closes: strings and their
    escapes skipped, brackets counted, the state kept between pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def find(self, text: str) -> int | None:
        """The index just past the close in ``text``, or None when it has not come yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
