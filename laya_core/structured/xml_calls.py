"""Qwen3-Coder's tool calls, read incrementally (the contract of
:mod:`laya_core.structured.tool_parsers`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from laya_core.structured.tool_parsers import Delta, TriggeredParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_VALUE_END = "</parameter>"


class XmlCallParser(TriggeredParser):
    """Qwen3-Coder's calls::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A parameter's value is text; it becomes JSON by its type in the tool's schema (a string
    stays text, an integer, number, boolean, object or array is read as JSON, and text
    that does not read stays a string). Its arguments stream one whole parameter at a time:
    ``{"city": "Paris"``, then ``}`` at ``</function>``."""

    def __init__(self, tools: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(("<tool_call>",))
        self._tools = tools  # name -> parameters schema

    def _step(self, out: list[Delta]) -> bool:
        call = self._call
        assert call is not None
        if call.name is None:
            found = _FUNCTION.match(self._buffer)
            if found is None:
                return False
            self._named(found.group(1).strip(), found.end(), out)
            call.opened = True
            return True
        if call.done:  # then its closing tag, if it comes
            rest = self._buffer.lstrip()
            if not rest or ("</tool_call>".startswith(rest) and rest != "</tool_call>"):
                return False
            if rest.startswith("</tool_call>"):
                self._buffer = rest[len("</tool_call>"):]
            self._call = None
            return True
        found = _PARAMETER.match(self._buffer)
        if found is not None:
            end = self._buffer.find(_VALUE_END, found.end())
            if end < 0:
                return False
            value = self._buffer[found.end():end]
            self._buffer = self._buffer[end + len(_VALUE_END):]
            key = found.group(1).strip()
            lead = ", " if call.arguments else "{"
            self._argument(f"{lead}{json.dumps(key)}: {json.dumps(self._typed(key, value))}",
                           out)
            return True
        rest = self._buffer.lstrip()
        if not rest.startswith("</function>"):
            return False  # a parameter or the function's end, still to come
        self._argument("}" if call.arguments else "{}", out)
        call.done = True
        self._buffer = rest[len("</function>"):]
        return True

    def _typed(self, key: str, value: str) -> Any:
        value = value.removeprefix("\n").removesuffix("\n")
        assert self._call is not None and self._call.name is not None
        schema = self._tools.get(self._call.name, {}).get("properties", {}).get(key, {})
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
