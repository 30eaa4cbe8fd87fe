"""Tool calling: the tools in the prompt, the grammar a call is generated under, and the
calls parsed back out of the text, whole or as OpenAI's stream deltas.

This module writes calls in Hermes' format, the one Hermes, Qwen 2.5/3 and SmolLM's
tool-trained models use, which is also what a model whose chat template knows no tools is
taught (:func:`generic_preamble`); the other families' formats (Llama 3, Mistral,
Qwen3-Coder, gpt-oss) are :mod:`laya_core.structured.tool_formats`', which
:func:`call_grammar` takes as ``fmt``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one per line. The constraint (:func:`call_grammar`) makes every call valid:
the name one of the tools', the arguments an object that validates against that tool's
``parameters``. With ``tool_choice`` ``required`` or a named function the whole output is
calls; with ``auto`` the text is free until the model writes ``<tool_call>``, and from that
marker on the call is constrained (a lazy trigger: the grammar does not constrain text
before it). ``parallel_tool_calls: false`` allows one call. With ``auto`` and a JSON
response format (tools with a typed answer) the output is calls, or an answer in the
format, and nothing else.

The parser (:class:`ToolCallParser`) reads the text as it streams: content outside calls
goes out as content (a partial ``<tool_call>`` is held back until it is one or is not), a
call's first delta carries its index, id, type and name, and later ones carry fragments of
its ``arguments`` exactly as generated, so that concatenated they equal the non-streamed
``arguments``, which the same parser produces.

An output cut short (``max_tokens``, a stop string) keeps what was generated: a call whose
name is complete is a call, with its ``arguments`` as far as they got; a call cut before
its name closed is returned as the text it is (``<tool_call>\n{"name": "get_w``), since a
name's beginning may be another tool's whole name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from laya_core.structured.call_parts import (  # noqa: F401 - new_call_id, JsonEnd: here too
    Call,
    CallList,
    JsonEnd,
    new_call_id,
    partial_suffix,
)
from laya_core.structured.formats import (
    closed_schema,
    json_options,
    numbers_grammar,
    schema_of,
)
from laya_core.structured.spec import ConstraintSpec

if TYPE_CHECKING:
    from laya_core.structured.tool_formats import ToolFormat

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@attrs.frozen
class Tool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema of an object
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as a chat template's ``tools`` list holds it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@attrs.frozen
class ToolUse:
    """What a chat request asks of tools. ``choice``: ``auto``, ``required`` or the name of
    the function to call (``none`` leaves no ToolUse at all)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def named(self) -> bool:
        return self.choice not in ("auto", "required")


def arguments_schema(tool: Tool) -> Mapping[str, Any]:
    """The schema a tool's arguments are generated under. ``strict`` (OpenAI's structured
    tool calls) closes every object to the properties it lists, as OpenAI's strict mode
    demands of the schema."""
    params = tool.parameters or _EMPTY_PARAMETERS
    if params == {"type": "object"} or params == {"type": "object", "properties": {}}:
        return _EMPTY_PARAMETERS  # no parameters: the arguments are {}
    return closed_schema(params) if tool.strict else params


def _call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": arguments_schema(t)},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": json_options()}


def call_grammar(use: ToolUse, param: str = "tools",
                 answer: ConstraintSpec | None = None,
                 fmt: ToolFormat | None = None) -> ConstraintSpec:
    """The constraint for a request's calls (see the module docstring). A forced call's
    numbers are bounded as a response format's are; with ``auto`` the text before a call is
    the model's own, digits included, so they are not.

    ``answer``, a JSON response format (:data:`~laya_core.structured.formats.JSON_KINDS`),
    makes ``auto`` an alternation: the output is calls from its first character, or one
    JSON value of that format, numbers bounded in both. A forced call leaves no room for
    an answer: the format is for a later turn's.

    ``fmt``: the model's call format (:mod:`laya_core.structured.tool_formats`); None is
    Hermes'."""
    import llguidance

    tools = [t for t in use.tools if t.name == use.choice] if use.named else list(use.tools)
    answer = None if use.forced else answer
    lark = hermes_lark(use, tools, answer) if fmt is None else fmt.lark(use, tools, answer)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    schemas = [t.parameters for t in tools]
    bounded = fmt is None or fmt.bounds_numbers
    controls = () if fmt is None else fmt.controls
    if answer is None:
        numbers = numbers_grammar(schemas, controls) if use.forced and bounded else ""
        return ConstraintSpec("tools", grammar, param, numbers=numbers)
    calls = call_grammar(attrs.evolve(use, choice="required"), param, fmt=fmt)
    return ConstraintSpec("tools_or_json", grammar, param,
                          numbers=numbers_grammar([*schemas, schema_of(answer)], controls)
                          if bounded else "",
                          parts=(calls, answer))


def hermes_lark(use: ToolUse, tools: Sequence[Tool], answer: ConstraintSpec | None) -> str:
    """:func:`call_grammar`'s Lark grammar for Hermes' format: calls alone (forced), calls or the answer,
    or free text up to a call (a lazy trigger)."""
    body = f'"\\n" %json {json.dumps(_call_schema(tools))} "\\n{CLOSE}"'
    more = f'("\\n" "{OPEN}" body)*' if use.parallel and not use.named else ""
    if use.forced:
        return f'start: "{OPEN}" body {more}\nbody: {body}\n'
    if answer is not None:
        return (f'start: answer | "{OPEN}" body {more}\n'
                f"answer: %json {json.dumps(schema_of(answer))}\n"
                f"body: {body}\n")
    return (f"start: TEXT | trigger body {more}\n"
            f'trigger[lazy]: TEXT "{OPEN}"\n'
            f"body: {body}\n"
            r"TEXT: /(.|\n)*/" + "\n")


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (for histories rendered without a tool template)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def generic_preamble(tools: Sequence[Tool]) -> str:
    """The system-prompt text that teaches tools to a model whose template has none."""
    lines = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. The functions, one per "
            f"line as JSON:\n{lines}\n\nTo call a function, reply with its name and its "
            f"arguments as a JSON object inside {OPEN} tags, one call per tag:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n{CLOSE}\n'
            "A function's result comes back in <tool_response> tags.")


def uses_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list itself."""
    return template is not None and re.search(r"\btools\b", template) is not None


def generic_messages(messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Tool] | None) -> list[dict[str, Any]]:
    """A tool conversation for a template that knows no tools: the preamble in the system
    message, calls written out in the assistant's text, results as user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["raw_arguments"])
                     for c in m["tool_calls"]]
            text = (m.get("content") or "").strip()
            m = {"role": "assistant", "content": "\n".join(([text] if text else []) + calls)}
        elif m["role"] == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    if tools:
        preamble = generic_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A tool conversation for a template that renders tools: arguments as objects (what
    such templates pass through ``tojson``), content as text."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items()}
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": c["function"]["arguments"]}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def prompt_messages(messages: Sequence[Mapping[str, Any]], use: ToolUse | None,
                    template: str | None) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The messages, and the ``tools`` list, to render a chat with: the template's own
    rendering where it knows tools, else the generic one (:func:`generic_messages`)."""
    tools = use.tools if use is not None else ()
    if uses_tools(template):
        return template_messages(messages), [t.as_openai() for t in tools] or None
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return generic_messages(messages, tools), None
    return [dict(m) for m in messages], None


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')


class ToolCallParser(CallList):
    """Splits generated text into content and tool calls, incrementally.

    :meth:`feed` takes the next piece of text and returns the deltas it completes: ``("content",
    text)`` and ``("call", {...})`` with OpenAI's tool-call delta fields. :meth:`finish`
    flushes what is held back. :attr:`calls` holds the complete calls afterwards.
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._in_call: Call | None = None
        self._json_end = JsonEnd()

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buffer += text
        out: list[tuple[str, Any]] = []
        while self._buffer:
            if self._in_call is None:
                if not self._text(out):
                    break
            elif not self._in_call.opened:
                if not self._head(out):
                    break
            elif not self._in_call.done:
                self._arguments(out)
            elif not self._close():
                break
        return out

    def _text(self, out: list[tuple[str, Any]]) -> bool:
        at = self._buffer.find(OPEN)
        if at < 0:
            keep = partial_suffix(self._buffer, OPEN)
            text, self._buffer = self._buffer[: len(self._buffer) - keep], \
                self._buffer[len(self._buffer) - keep:]
            # Blank lines between calls are layout, not content.
            if text and not (self._calls and not text.strip()):
                out.append(("content", text))
            return False
        text = self._buffer[:at]
        if text and not (self._calls and not text.strip()):
            out.append(("content", text))
        self._buffer = self._buffer[at + len(OPEN):]
        self._in_call = Call(len(self._calls), new_call_id())
        self._calls.append(self._in_call)
        return True

    def _head(self, out: list[tuple[str, Any]]) -> bool:
        """Read the call's name (then its first delta goes out), then its arguments' key."""
        call = self._in_call
        assert call is not None
        if call.name is None:
            found = _NAME.match(self._buffer)
            if found is None:
                return False
            call.name = json.loads(found.group(1))
            self._buffer = self._buffer[found.end():]
            out.append(("call", {"index": call.index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}))
        found = _ARGUMENTS_KEY.match(self._buffer)
        if found is None:
            return False
        call.opened = True
        self._buffer = self._buffer[found.end():]
        return True

    def _arguments(self, out: list[tuple[str, Any]]) -> None:
        """Pass the arguments' characters through until their object closes."""
        assert self._in_call is not None
        end = self._json_end.find(self._buffer)
        if end is None:
            end = len(self._buffer)
        else:
            self._in_call.done = True
        piece, self._buffer = self._buffer[:end], self._buffer[end:]
        if not self._in_call.arguments:
            piece = piece.lstrip()
        if piece:
            self._in_call.arguments.append(piece)
            out.append(("call", {"index": self._in_call.index,
                                 "function": {"arguments": piece}}))

    def _close(self) -> bool:
        at = self._buffer.find(CLOSE)
        if at < 0:
            return False
        self._buffer = self._buffer[at + len(CLOSE):]
        self._in_call = None
        return True

    def finish(self) -> list[tuple[str, Any]]:
        """What is held back at the end: a partial marker is content after all, and so is a
        call cut before its name closed (its marker and all, exactly as generated)."""
        out: list[tuple[str, Any]] = []
        call = self._in_call
        if call is not None and call.name is None:
            self._calls.remove(call)
            self._in_call = None
            self._buffer = OPEN + self._buffer
        if self._in_call is None and self._buffer \
                and not (self._calls and not self._buffer.strip()):
            out.append(("content", self._buffer))
        self._buffer = ""
        return out
