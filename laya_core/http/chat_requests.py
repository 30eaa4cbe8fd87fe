"""Parsing a POST /v1/chat/completions body: messages, tools and tool_choice, on top of the
fields every generation request shares (:mod:`laya_core.http.completion_requests`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from laya_core.http import safe_json
from laya_core.http.completion_requests import (
    INT32_MAX,
    MAX_TOP_LOGPROBS,
    Body,
    ChatRequest,
    GenerationRequest,
    common_fields,
)
from laya_core.http.errors import invalid
from laya_core.serving.chat_template import RESERVED
from laya_core.structured.formats import JSON_KINDS
from laya_core.structured.spec import GrammarError
from laya_core.structured.tools import Tool, ToolUse, call_grammar

_ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise invalid(f"{param}[{j}]", "only text content parts "
                              '({"type": "text", "text": ...}) are supported')
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(param, "message content must be a string or a list of text parts",
                  "invalid_type")


def _history_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: arguments a JSON string (OpenAI's) or an object,
    kept both parsed (for templates) and as text (for the generic rendering)."""
    if not isinstance(raw, list) or not raw:
        raise invalid(param, "'tool_calls' must be a non-empty array of calls", "invalid_type")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise invalid(f"{param}[{j}].function", "each call needs a 'function' with a "
                          "'name' and 'arguments'")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):  # JSON in a string: the body's depth bound missed it
            parsed = safe_json.loads_field(args or "{}", f"{param}[{j}].function.arguments")
        else:
            parsed = args
        if not isinstance(parsed, dict):
            raise invalid(f"{param}[{j}].function.arguments", "'arguments' must be a JSON "
                          "object, as a string")
        call_id = call.get("id")
        calls.append({"id": call_id if isinstance(call_id, str) else f"call_{j}",
                      "type": "function",
                      "function": {"name": fn["name"], "arguments": parsed,
                                   "raw_arguments": json.dumps(parsed, ensure_ascii=False)}})
    return calls


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise invalid(f"messages[{i}]", "each message must be an object", "invalid_type")
    role = m.get("role")
    if role not in _ROLES:
        raise invalid(f"messages[{i}].role",
                      f"role must be one of {', '.join(_ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        content = m.get("content")
        out["content"] = None if content is None else _content_text(
            content, f"messages[{i}].content")
        return out
    if m.get("content") is None:
        raise invalid(f"messages[{i}].content", "message content is required", "missing")
    out["content"] = _content_text(m["content"], f"messages[{i}].content")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"messages[{i}].tool_call_id", "a tool message needs the "
                          "'tool_call_id' of the call it answers", "missing")
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _tool(raw: Any, param: str) -> Tool:
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function" \
            or not isinstance(raw.get("function"), Mapping):
        raise invalid(param, 'each tool must be {"type": "function", "function": {...}}')
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(f"{param}.function.name", "a function's name must be 1 to 64 letters, "
                      f"digits, '_', '.', ':' or '-', got {name!r}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{param}.function.description", "'description' must be a string")
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise invalid(f"{param}.function.parameters", "'parameters' must be a JSON schema "
                      'of an object ({"type": "object", ...})')
    strict = fn.get("strict", False)
    if not isinstance(strict, (bool, type(None))):
        raise invalid(f"{param}.function.strict", "'strict' must be a boolean")
    return Tool(name, description, dict(parameters), bool(strict))


def _tool_use(b: Body, common: GenerationRequest) -> ToolUse | None:
    raw = b.get("tools", list, [])
    if len(raw) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    if len({t.name for t in tools}) < len(tools):
        raise invalid("tools", "two tools have the same name")
    choice = b.body.get("tool_choice")
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("tool_choice", 'a named tool_choice is {"type": "function", '
                          '"function": {"name": ...}}')
        if name not in {t.name for t in tools}:
            raise invalid("tool_choice.function.name", f"tool_choice names {name!r}, which "
                          "is not one of 'tools'")
        choice = name
    elif choice is None:
        choice = "auto" if tools else "none"
    elif choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "tool_choice must be none, auto, required or "
                      '{"type": "function", "function": {"name": ...}}')
    if choice != "none" and not tools:
        raise invalid("tool_choice", f"tool_choice {choice!r} needs 'tools'")
    parallel = b.get("parallel_tool_calls", bool, True)
    if choice == "none":
        return None
    constraint = common.constraint
    if constraint is not None and constraint.kind not in JSON_KINDS:
        raise invalid(constraint.param, f"'{constraint.param}' cannot be combined with "
                      "tools: a JSON answer (json_schema or json_object) can; send "
                      "tool_choice \"none\" to use it alone")
    return ToolUse(tools, choice, parallel)


def parse_chat(body: Any) -> ChatRequest:
    b = Body(body)
    top = b.get("top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    wanted = b.get("logprobs", bool, False)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    common = common_fields(b, (top or 0) if wanted else None)
    raw = b.get("messages", list)
    if not raw:
        raise invalid("messages", "'messages' must be a non-empty array of messages", "missing")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    use = _tool_use(b, common)
    continue_final = b.get("continue_final_message", bool, False)
    if continue_final:
        check_prefill(messages, common, use, "continue_final_message")
    if use is not None:
        try:
            # A JSON format with tool_choice auto: call, or answer in it (call_grammar).
            common = attrs.evolve(common, constraint=call_grammar(use, answer=common.constraint))
        except GrammarError as e:
            raise invalid(e.param, str(e)) from None
    return ChatRequest(common, messages, use, continue_final, _template_vars(b),
                       b.integer("max_reasoning_tokens", 1, INT32_MAX))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _template_vars(b: Body) -> dict[str, Any]:
    """``chat_template_kwargs`` and ``reasoning_effort``: names for the chat template."""
    out = dict(b.get("chat_template_kwargs", dict, {}))
    for key in out:
        if key in RESERVED:
            raise invalid(f"chat_template_kwargs.{key}", f"'{key}' is the conversation's or "
                          "the model's to set, not a template variable of the request")
    effort = b.get("reasoning_effort", str)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid("reasoning_effort", "'reasoning_effort' must be one of "
                          + ", ".join(REASONING_EFFORTS))
        out["reasoning_effort"] = effort
    return out


def check_prefill(messages: tuple[dict[str, Any], ...], common: GenerationRequest,
                  use: ToolUse | None, param: str) -> None:
    """A conversation whose last message the model continues: that message the assistant's
    text, and no constraint that would start from the beginning of the turn."""
    last = messages[-1]
    if last["role"] != "assistant" or not isinstance(last.get("content"), str) \
            or last.get("tool_calls"):
        raise invalid(param, "continuing the final message needs the last message to be "
                      "the assistant's text")
    if common.constraint is not None or (use is not None and use.forced):
        raise invalid(param, "continuing the final message cannot go with a response "
                      "format or a forced tool call: they constrain the turn from its start")
