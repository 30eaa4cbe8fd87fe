"""The tool-call formats of the main model families: how each writes a call, the grammar
that constrains a call from its trigger on, and the parser that reads it back.

==============  ===========================================================================
``hermes``      ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes,
                Qwen 2.5/3, SmolLM; and what a template without tools is taught)
``llama3_json`` ``{"name": ..., "parameters": {...}}`` at the start of the reply, or after
                ``<|python_tag|>``; calls apart by ``; ``
``mistral``     ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
``mistral_args`` ``[TOOL_CALLS]name[ARGS]{...}``, once per call (Mistral's newer tokenizers)
``qwen3_coder`` ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
                </function>\\n</tool_call>``, values typed by the tool's schema
``harmony``     ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
                <|call|>`` (gpt-oss; only the call: its other channels are text here)
==============  ===========================================================================

A model's format is detected from markers in its chat template's Jinja text
(:func:`detect`); a template that renders no tools is taught Hermes' format, and a
deployment may name another (:func:`tool_format`'s ``override``).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from laya_core.models.tokenizer import Tokenizer
from laya_core.structured.formats import MAX_INTEGER_DIGITS, json_options, schema_of
from laya_core.structured.markup import controls_in, lark_literal
from laya_core.structured.reasoning import harmony_body
from laya_core.structured.spec import ConstraintSpec, GrammarError
from laya_core.structured.tool_parsers import CallParser, JsonCallParser, JsonSyntax
from laya_core.structured.tools import (
    Tool,
    ToolCallParser,
    ToolUse,
    arguments_schema,
    hermes_lark,
    uses_tools,
)
from laya_core.structured.xml_calls import XmlCallParser

_JSON_NAME = r'\s*\{?\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


@attrs.frozen
class ToolFormat:
    """One family's calls. ``trigger``: the text a call begins with (the grammar's lazy
    trigger with ``tool_choice`` auto); ``separator``: between two calls of one reply
    (None: one call a reply); ``group_end``: after the last."""

    name: str
    trigger: str
    separator: str | None
    group_end: str = ""
    opener: str = ""  # after the trigger, before the first call: Mistral's "["
    bounds_numbers: bool = True  # a forced call gets the JSON number bounds
    # The markup that is one control token in the family's own vocabularies, and of it
    # (text, id) where the model's vocabulary has it so (laya_core/structured/markup.py):
    # the grammar writes those as tokens, and the output shows them to the parser.
    markup: tuple[str, ...] = ()
    controls: tuple[tuple[str, int], ...] = ()

    def lit(self, text: str) -> str:
        return lark_literal(text, self.controls)

    def lark(self, use: ToolUse, tools: Sequence[Tool],
             answer: ConstraintSpec | None) -> str:
        """The grammar of a request's calls: calls alone (forced), calls or the answer, or
        free text up to a call's trigger (a lazy trigger: the text before is the model's)."""
        sep = self.separator if use.parallel and not use.named else None
        group = "call" + (f" ({self.lit(sep)} call)*" if sep else "") \
            + (f" {self.lit(self.group_end)}" if self.group_end else "")
        rules = f"group: {group}\n" + self.call_rules(tools)
        if use.forced:
            return f"start: {self._opening(forced=True)} group\n" + rules
        if answer is not None:
            return (f"start: answer | {self._opening(forced=False)} group\n"
                    f"answer: %json {json.dumps(schema_of(answer))}\n" + rules)
        return self._free_text(rules)

    def _free_text(self, rules: str) -> str:
        """``tool_choice`` auto: the model's text, up to a call's trigger."""
        opener = f" {self.lit(self.opener)}" if self.opener else ""
        return (f"start: TEXT | trigger{opener} group\n{self._trigger()}\n" + rules
                + "TEXT: /(.|\\n)*/\n")

    def _trigger(self) -> str:
        """The rule of free text up to a call's trigger. Text lazily, up to the trigger
        spelt out; where the trigger begins with a control token, text can hold no such
        token, so the token ends it (and a lazy rule, a lexeme, cannot hold a token)."""
        trigger = self.lit(self.trigger)
        lazy = "" if trigger.startswith("<[") else "[lazy]"
        return f"trigger{lazy}: TEXT {trigger}"

    def _opening(self, forced: bool) -> str:
        """What comes before the calls where nothing comes before them."""
        return self.lit(self.trigger) + (f" {self.lit(self.opener)}" if self.opener else "")

    def call_rules(self, tools: Sequence[Tool]) -> str:
        raise NotImplementedError

    def parser(self, use: ToolUse, answer: bool = False) -> CallParser:
        """A fresh parser of a reply (``answer``: the request has a typed answer)."""
        raise NotImplementedError


def _named_calls(fmt: ToolFormat, tools: Sequence[Tool], head: str, tail: str = "") -> str:
    """``call`` as one alternative per tool: ``head`` (with {name}), the arguments, ``tail``."""
    lines = ["call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        args = {**arguments_schema(t), "x-guidance": json_options()}
        lines.append(f"c{i}: {fmt.lit(head.format(name=t.name))} %json {json.dumps(args)}"
                     + (f" {fmt.lit(tail)}" if tail else ""))
    return "\n".join(lines) + "\n"


def _object_call(tools: Sequence[Tool], key: str) -> str:
    """``call`` as one JSON object ``{"name": ..., key: {...}}``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, key: arguments_schema(t)},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return f"call: %json {json.dumps({**schema, 'x-guidance': json_options()})}\n"


@attrs.frozen
class Hermes(ToolFormat):
    def lark(self, use: ToolUse, tools: Sequence[Tool],
             answer: ConstraintSpec | None) -> str:
        return hermes_lark(use, tools, answer)  # today's grammar, as it was

    def parser(self, use: ToolUse, answer: bool = False) -> ToolCallParser:
        return ToolCallParser()


@attrs.frozen
class Llama3Json(ToolFormat):
    def _free_text(self, rules: str) -> str:
        # A reply that begins with "{" is a call; other text is free until <|python_tag|>.
        return (f"start: TEXT | group | trigger group\n{self._trigger()}\n" + rules
                + "TEXT: /([^{](.|\\n)*)?/\n")

    def _opening(self, forced: bool) -> str:
        # A forced call is written bare, as the template teaches; beside a typed answer,
        # whose JSON would begin as a call does, after <|python_tag|>.
        return "" if forced else self.lit(self.trigger)

    def call_rules(self, tools: Sequence[Tool]) -> str:
        return _object_call(tools, "parameters")

    def parser(self, use: ToolUse, answer: bool = False) -> JsonCallParser:
        # Beside a typed answer, whose JSON may begin as a call does, only <|python_tag|>
        # opens a call (the grammar writes it so).
        return JsonCallParser(JsonSyntax(
            ("<|python_tag|>",), re.compile(_JSON_NAME),
            re.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'),
            leading="" if answer else "{", call_close="}", separator=";"))


def mistral_call_id() -> str:
    """A call id as Mistral's templates demand of a history's calls: 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@attrs.frozen
class Mistral(ToolFormat):
    def call_rules(self, tools: Sequence[Tool]) -> str:
        return _object_call(tools, "arguments")

    def parser(self, use: ToolUse, answer: bool = False) -> JsonCallParser:
        return JsonCallParser(JsonSyntax(
            (self.trigger,), re.compile(_JSON_NAME), re.compile(r'\s*,\s*"arguments"\s*:\s*'),
            group_open="[", call_close="}", separator=",", group_close="]"), mistral_call_id)


@attrs.frozen
class MistralArgs(ToolFormat):
    def call_rules(self, tools: Sequence[Tool]) -> str:
        return _named_calls(self, tools, "{name}[ARGS]")

    def parser(self, use: ToolUse, answer: bool = False) -> JsonCallParser:
        return JsonCallParser(JsonSyntax(
            (self.trigger,), re.compile(r"\s*([A-Za-z0-9_.:-]+)(?=\[)"),
            re.compile(r"(?:\[CALL_ID\][^\[]*)?\[ARGS\]"), json_name=False), mistral_call_id)


@attrs.frozen
class Harmony(ToolFormat):
    def _free_text(self, rules: str) -> str:
        """``tool_choice`` auto. Where ``<|channel|>`` is a control token (gpt-oss's own
        vocabulary), free text cannot hold it, so the messages that may come before a call
        (``analysis``, a ``commentary`` preamble) are written out: each ends ``<|end|>``
        and opens the next ``<|start|>assistant``; the reply ends in a last message, or a
        call (text before the first channel, which gpt-oss does not write, is let through). Otherwise the channels are text, and free text runs up to the call's
        trigger as in every family."""
        channel = dict(self.controls).get("<|channel|>")
        if channel is None:
            return super()._free_text(rules)
        body, body_rule = harmony_body(self.lit)
        return (f"start: TEXT? message* (last | <[{channel}]> "
                f"{self.lit('commentary to=functions.')} group)?\n"
                f"message: <[{channel}]> HEAD {self.lit('<|message|>')} {body} "
                f"{self.lit('<|start|>assistant')}\n"
                f"last: <[{channel}]> HEAD {self.lit('<|message|>')} TEXT\n{body_rule}\n"
                + rules + "HEAD: /[a-z]+/\nTEXT: /(.|\\n)*/\n")

    def call_rules(self, tools: Sequence[Tool]) -> str:
        return _named_calls(self, tools, "{name} <|constrain|>json<|message|>", "<|call|>")

    def parser(self, use: ToolUse, answer: bool = False) -> JsonCallParser:
        # The recipient may come before the channel too (how the template writes history).
        return JsonCallParser(JsonSyntax(
            ("<|start|>assistant<|channel|>commentary to=functions.",
             "<|channel|>commentary to=functions.", "<|start|>assistant to=functions."),
            re.compile(r"([A-Za-z0-9_.:-]+?)(?=[\s<])"),
            re.compile(r"[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>"),
            json_name=False, call_close="<|call|>"))


# A string value is text without "</" in it, so that its closing tag ends it.
_XML_TEXT = r"([^<]|<[^\/])*"
_XML_SCALARS = {
    "integer": rf"-?(0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})",
    "number": rf"-?(0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})(\.[0-9]{{1,23}})?"
              r"([eE][+-]?[0-9]{1,3})?",
    "boolean": "true|false",
}


@attrs.frozen
class Qwen3Coder(ToolFormat):
    def call_rules(self, tools: Sequence[Tool]) -> str:
        lines = ["call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            schema = arguments_schema(t)
            required = set(schema.get("required", ()))
            params = []
            for j, (key, prop) in enumerate(dict(schema.get("properties", {})).items()):
                lines.append(f"p{i}_{j}: {_lit(f'<parameter={key}>' + chr(10))} "
                             + _xml_value(t, key, prop))
                params.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
            lines.append(f"c{i}: {_lit(f'{chr(10)}<function={t.name}>{chr(10)}')} "
                         + " ".join(params) + f" {_lit('</function>' + chr(10) + '</tool_call>')}")
        return "\n".join(lines) + "\n"

    def parser(self, use: ToolUse, answer: bool = False) -> XmlCallParser:
        return XmlCallParser({t.name: arguments_schema(t) for t in use.tools})


_CLOSE = "\n</parameter>\n"


def _xml_value(tool: Tool, key: str, prop: Any) -> str:
    """The grammar of one parameter's value and its closing tag: text for a string (one
    terminal with its tag, since the text may hold a line break), a bounded number, or
    JSON."""
    kind = prop.get("type") if isinstance(prop, Mapping) else None
    if kind == "string":
        if "pattern" in prop or "format" in prop:
            raise GrammarError("tools", f"tool {tool.name!r}: parameter {key!r} has a "
                               "'pattern' or 'format', which this model's call format "
                               "(qwen3_coder, values as plain text) cannot enforce")
        if "enum" in prop:
            return "(" + " | ".join(_lit(f"{v}{_CLOSE}") for v in prop["enum"]) + ")"
        low, high = prop.get("minLength", 0), prop.get("maxLength")
        text = f"[^<]{{{low},{'' if high is None else high}}}" \
            if high is not None or low else _XML_TEXT
        return rf"/{text}\n<\/parameter>\n/"
    if kind in _XML_SCALARS and "enum" not in prop:
        return f"/{_XML_SCALARS[kind]}/ {_lit(_CLOSE)}"
    return f"%json {json.dumps({**prop, 'x-guidance': json_options()})} {_lit(_CLOSE)}"


# gpt-oss's channel markup: one control token each in its vocabulary.
HARMONY_MARKUP = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>",
                  "<|end|>", "<|return|>")
HERMES = Hermes("hermes", "<tool_call>", "\n<tool_call>")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    HERMES,
    Llama3Json("llama3_json", "<|python_tag|>", "; ", markup=("<|python_tag|>",)),
    Mistral("mistral", "[TOOL_CALLS]", ", ", "]", "[", markup=("[TOOL_CALLS]",)),
    MistralArgs("mistral_args", "[TOOL_CALLS]", "[TOOL_CALLS]",
                markup=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    Qwen3Coder("qwen3_coder", "<tool_call>", "\n<tool_call>", bounds_numbers=False),
    Harmony("harmony", "<|channel|>commentary to=functions.", None, markup=HARMONY_MARKUP),
)}

# Distinctive text of each family's published chat templates, checked in this order
# (Qwen3-Coder's template holds "<tool_call>" too, Mistral's newer ones "[TOOL_CALLS]").
# Qwen3-Coder's XML is also Qwen3.5's, Nemotron 3's and StepFun 3.5's; Seed-OSS writes it
# inside <seed:tool_call>, which no format here reads.
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|call|>")),
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),
    ("mistral_args", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),
)


@functools.lru_cache(maxsize=64)
def detect(template: str | None) -> str:
    """The family a chat template writes calls in: Hermes' where it renders no tools (the
    generic format) or where no other family's markers are in it."""
    if template is None or not uses_tools(template):
        return HERMES.name
    for name, markers in _MARKERS:
        if all(m in template for m in markers):
            return name
    return HERMES.name


@functools.lru_cache(maxsize=64)  # asked several times a request with tools
def tool_format(template: str | None, override: str | None = None,
                tokenizer: Tokenizer | None = None) -> ToolFormat:
    """The model's call format: ``override`` (a deployment's choice; "auto" or None:
    detect it), else the one its chat template shows; with ``tokenizer``, its markup's
    control tokens in that vocabulary."""
    if override not in (None, "auto"):
        if override not in FORMATS:
            raise ValueError(f"unknown tool-call format {override!r}; the formats are: "
                             + ", ".join(FORMATS))
        fmt = FORMATS[override]
    else:
        fmt = FORMATS[detect(template)]
    if tokenizer is None or not fmt.markup:
        return fmt
    return attrs.evolve(fmt, controls=controls_in(fmt.markup, tokenizer))
