"""Incremental parsers of the tool-call formats other than Hermes' (which is
:class:`~laya_core.structured.tools.ToolCallParser`), with the same contract:

:meth:`feed` takes the next piece of text and returns the deltas it completes,
``("content", text)`` and ``("call", {...})`` with OpenAI's tool-call delta fields;
:meth:`finish` flushes what is held back; :attr:`calls` and :attr:`complete` describe the
calls afterwards. Text outside calls is content, less only what could still be the start
of a trigger; a call's first delta carries its index, id, type and name, later ones
fragments of its ``arguments``, so that joined they equal the non-streamed ``arguments``
at every split of the text. A call cut before its name is complete is content, exactly as
generated (its trigger included); one cut later has its arguments as far as they got.

:class:`JsonCallParser` reads every family whose arguments are a JSON object, from a
:class:`JsonSyntax`; :class:`~laya_core.structured.xml_calls.XmlCallParser` reads
Qwen3-Coder's XML.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from laya_core.structured.call_parts import Call, CallList, JsonEnd, new_call_id, partial_suffix

Delta = tuple[str, Any]


class CallParser(Protocol):
    """What every family's parser offers (Hermes' ToolCallParser included)."""

    @property
    def calls(self) -> list[dict[str, Any]]: ...

    @property
    def complete(self) -> bool: ...

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class TriggeredParser(CallList):
    """Text, triggers and calls: what every family shares. A subclass reads one call from
    ``self._buffer`` (:meth:`_step`, False while it needs more text) after :meth:`_open`
    saw its trigger."""

    def __init__(self, triggers: Sequence[str], leading: str = "",
                 call_id: Callable[[], str] = new_call_id) -> None:
        self._triggers = tuple(triggers)
        self._call_id = call_id
        self._leading = leading  # a trigger only at the output's start (after whitespace)
        self._started = not leading
        super().__init__()
        self._buffer = ""
        self._call: Call | None = None

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while self._buffer:
            if self._call is None:
                if not self._text(out):
                    break
            elif not self._step(out):
                break
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        call = self._call
        if call is not None and call.name is None:  # cut inside its name: text after all
            self._calls.remove(call)
            self._buffer = call.raw + self._buffer
            self._call = None
        if self._call is None:
            self._content(self._buffer, out)
        self._buffer = ""
        return out

    def _content(self, text: str, out: list[Delta]) -> None:
        # Blank text between calls is layout, not content.
        if text and not (self._calls and not text.strip()):
            out.append(("content", text))

    def _text(self, out: list[Delta]) -> bool:
        if not self._started:
            rest = self._buffer.lstrip()
            if not rest:
                return False
            self._started = True
            if rest.startswith(self._leading):
                at = len(self._buffer) - len(rest) + len(self._leading)
                trigger, self._buffer = self._buffer[:at], self._buffer[at:]
                self._open(trigger)
                return True
        found = [(at, t) for t in self._triggers if (at := self._buffer.find(t)) >= 0]
        if not found:
            keep = max(partial_suffix(self._buffer, t) for t in self._triggers)
            self._content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, trigger = min(found, key=lambda f: (f[0], -len(f[1])))
        self._content(self._buffer[:at], out)
        self._buffer = self._buffer[at + len(trigger):]
        self._open(trigger)
        return True

    def _open(self, trigger: str) -> None:
        self._call = Call(len(self._calls), self._call_id(), trigger)
        self._calls.append(self._call)

    def _named(self, name: str, consumed: int, out: list[Delta]) -> None:
        """The call's name is complete: its first delta goes out."""
        call = self._call
        assert call is not None
        call.name, call.raw = name, ""
        self._buffer = self._buffer[consumed:]
        out.append(("call", {"index": call.index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}}))

    def _argument(self, piece: str, out: list[Delta]) -> None:
        call = self._call
        assert call is not None
        if piece:
            call.arguments.append(piece)
            out.append(("call", {"index": call.index, "function": {"arguments": piece}}))

    def _step(self, out: list[Delta]) -> bool:
        raise NotImplementedError


@attrs.frozen
class JsonSyntax:
    """How a family writes calls whose arguments are one JSON object. Literals may follow
    whitespace; a regular expression is matched at the start of what is left."""

    triggers: tuple[str, ...]  # text that opens a call, or a group of calls
    name: re.Pattern[str]  # group 1: the name (a JSON string where ``json_name``)
    arguments: re.Pattern[str]  # from the name's end to the arguments' object
    json_name: bool = True
    leading: str = ""  # a trigger only at the output's start: Llama 3's bare "{"
    group_open: str = ""  # after a trigger: Mistral's "["
    call_close: str = ""  # after the arguments: "}" where name and arguments share an object
    separator: str | None = None  # between the calls of one group
    group_close: str = ""  # after a group's last call


class JsonCallParser(TriggeredParser):
    def __init__(self, syntax: JsonSyntax, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(syntax.triggers, syntax.leading, call_id)
        self.syntax = syntax
        self._json_end = JsonEnd()
        self._stage = "open"  # open, name, arguments, json, close, next

    def _open(self, trigger: str) -> None:
        super()._open(trigger)
        self._stage = "open" if self.syntax.group_open else "name"

    def _step(self, out: list[Delta]) -> bool:
        call = self._call
        assert call is not None
        s = self.syntax
        if self._stage == "open":
            return self._literal(s.group_open, "name", raw=True)
        if self._stage == "name":
            found = s.name.match(self._buffer)
            if found is None:
                return False
            name = json.loads(found.group(1)) if s.json_name else found.group(1)
            self._named(name, found.end(), out)
            self._stage = "arguments"
            return True
        if self._stage == "arguments":
            found = s.arguments.match(self._buffer)
            if found is None:
                return False
            self._buffer = self._buffer[found.end():]
            call.opened, self._stage = True, "json"
            return True
        if self._stage == "json":
            self._json(out)
            return True
        if self._stage == "close":
            return self._literal(s.call_close, "next")
        return self._next()

    def _literal(self, literal: str, then: str, raw: bool = False) -> bool:
        """Skip ``literal`` (after whitespace) if it comes, and go on to stage ``then``."""
        if not literal:
            self._stage = then
            return True
        rest = self._buffer.lstrip()
        if not rest:
            return False
        if literal.startswith(rest) and rest != literal:
            return False  # all of it could still be the literal
        if rest.startswith(literal):
            if raw and self._call is not None:
                self._call.raw += self._buffer[: len(self._buffer) - len(rest) + len(literal)]
            self._buffer = rest[len(literal):]
        self._stage = then
        return True

    def _next(self) -> bool:
        """After a call: the next of its group, the group's end, or text."""
        s = self.syntax
        rest = self._buffer.lstrip()
        if not rest:
            return False
        for literal, more in ((s.separator, True), (s.group_close, False)):
            if not literal:
                continue
            if literal.startswith(rest) and rest != literal:
                return False
            if rest.startswith(literal):
                self._buffer = rest[len(literal):]
                if more:
                    self._open(literal)
                    self._stage = "name"
                    return True
                break
        self._call = None
        return True

    def _json(self, out: list[Delta]) -> None:
        """Pass the arguments' characters through until their object closes."""
        call = self._call
        assert call is not None
        end = self._json_end.find(self._buffer)
        if end is None:
            end = len(self._buffer)
        else:
            call.done = True
            self._stage = "close"
        piece, self._buffer = self._buffer[:end], self._buffer[end:]
        if not call.arguments:
            piece = piece.lstrip()
        self._argument(piece, out)
