"""Parsing a POST /v1/responses body (OpenAI's Responses API) into a :class:`ChatRequest`.

The body is translated into the chat completions body it means (``input`` and
``instructions`` into messages, ``text.format`` into ``response_format``, flat function tools
into chat's nested ones, ``max_output_tokens`` into ``max_tokens``) and parsed by
:func:`parse_chat`, so both APIs share one validation, one prompt and one constraint. An
error names the Responses field, not the chat field it became (:func:`renamed`).

A ``previous_response_id``'s conversation (:mod:`laya_core.http.response_store`) comes
before ``input``, and its instructions are not carried over, as OpenAI continues one.
What is not implemented is refused with a 400 naming it: the other stored-state fields
(``conversation``, ``prompt``, ``background``), hosted tool types, input items other than messages with text
parts, function calls, their outputs and reasoning items (a reasoning item is accepted and
left out of the prompt, as chat templates leave past reasoning out).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from laya_core.http.chat_requests import parse_chat
from laya_core.http.completion_requests import ChatRequest
from laya_core.http.errors import APIError, invalid

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16
# Fields that would need stored state or features this server does not have, with the values
# that mean "off"; anything else is refused, naming the field.
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "conversation": (None,), "prompt": (None,),
    "background": (None, False), "include": (None, []), "truncation": (None, "disabled"),
    "top_logprobs": (None, 0), "max_tool_calls": (None,),
}
# Chat fields, in parse_chat's errors, and the Responses fields they came from (longest first).
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"), ("tool_choice.function", "tool_choice"),
            ("reasoning_effort", "reasoning.effort"),
            ("messages", "input"))
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function")


@attrs.frozen
class ResponsesRequest:
    """A parsed Responses request: the chat request it runs as, and what the response
    object repeats back."""

    chat: ChatRequest
    echo: dict[str, Any]  # instructions, metadata, text, tools, tool_choice, ...
    # The conversation so far as chat messages, without instructions: a previous
    # response's, then this input (what a stored response continues from).
    conversation: tuple[dict[str, Any], ...] = ()
    store: bool = True
    # This request's input as items (a string input as one user message), each with an id:
    # what GET /v1/responses/{id}/input_items lists.
    input_items: tuple[dict[str, Any], ...] = ()


def renamed(e: APIError) -> APIError:
    """``e`` with the chat field it names replaced by the Responses field it came from."""
    param = e.param
    if param is None:
        return e
    new = _TOOL_PARAM.sub(r"tools[\1]", param)
    for old, to in _RENAMES:
        if new == old or new.startswith((old + ".", old + "[")):
            new = to + new[len(old):]
            break
    message = e.message.replace(f"'{param}'", f"'{new}'").replace(
        "'max_tokens'", "'max_output_tokens'").replace("'response_format'", "'text.format'")
    return APIError(e.status, message, param=new, code=e.code, retry_after=e.retry_after)


def _text(content: Any, param: str) -> str:
    """A message's or output's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, "content must be a string or a list of input_text parts",
                      "invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(f"{param}[{j}].type" if kind else f"{param}[{j}]",
                          f"content part type {kind!r} is not supported: this model reads "
                          "text only (input_text parts)", "unsupported_parameter")
        parts.append(part["text"])
    return "".join(parts)


def input_items(raw: Any) -> tuple[dict[str, Any], ...]:
    """``input`` (already checked by :func:`_messages`) as the Responses API lists it back:
    items with their own ``id`` kept and one given to the others, a string as a user
    message with one ``input_text`` part, a message's string content as such a part."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": raw}] \
        if isinstance(raw, str) else [dict(item) for item in raw]
    out = []
    for item in items:
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind, "item")
        item.setdefault("id", f"{prefix}_{uuid.uuid4().hex}")
        out.append(item)
    return tuple(out)


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages from ``input``."""
    out: list[dict[str, Any]] = []
    if isinstance(raw, str):
        if not raw:
            raise invalid("input", "'input' must not be empty", "missing")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("input", "'input' must be a string or a non-empty array of items",
                      "missing" if raw is None or raw == [] else "invalid_type")
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid(param, "each input item must be an object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"{param}.role", f"role must be one of {', '.join(_ROLES)}, "
                              f"got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"{param}.{key}", f"a function_call item needs '{key}' as "
                                  "a string", "missing")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise invalid(f"{param}.call_id", "a function_call_output item needs the "
                              "'call_id' of the call it answers", "missing")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue  # past reasoning stays out of the prompt, as chat templates leave it
        else:
            raise invalid(f"{param}.type", f"input item type {kind!r} is not supported; use "
                          "message, function_call, function_call_output or reasoning",
                          "unsupported_parameter")
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid("tools", "'tools' must be an array", "invalid_type")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise invalid(f"tools[{i}].type", f"tool type {kind!r} is not supported; only "
                          "function tools are", "unsupported_parameter")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw  # none, auto, required; parse_chat checks the value
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    raise invalid("tool_choice", f"tool_choice {kind or raw!r} is not supported; use none, "
                  'auto, required or {"type": "function", "name": ...}', "unsupported_parameter")


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise invalid("text", "'text' must be an object", "invalid_type")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "'text.verbosity' is not supported; remove it or "
                      "send medium", "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise invalid("text.format", "'text.format' must be an object", "invalid_type")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description")
                  if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") not in ("text", "json_object"):
        raise invalid("text.format.type", "'text.format.type' must be text, json_object or "
                      f"json_schema, got {fmt.get('type')!r}")
    return {"type": fmt["type"]}


def _metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or len(raw) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in raw.items()):
        raise invalid("metadata", f"'metadata' must be an object of at most {MAX_METADATA} "
                      "string values (keys up to 64 characters, values up to 512)")
    return dict(raw)


def _reasoning(value: Any) -> dict[str, Any]:
    """``reasoning``: its ``effort`` reaches the chat template as ``reasoning_effort``; a
    ``summary`` is not written (the reasoning item carries the reasoning itself)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise invalid("reasoning", "'reasoning' must be an object", "invalid_type")
    for name in value:
        if name not in ("effort", "summary", "generate_summary"):
            raise invalid(f"reasoning.{name}", "is not supported by this server",
                          "unsupported_parameter")
    return {"reasoning_effort": value["effort"]} if value.get("effort") is not None else {}


def parse_responses(body: Any, history: tuple[dict[str, Any], ...] = ()) -> ResponsesRequest:
    """``body`` parsed; ``history``: the conversation of its ``previous_response_id``."""
    if not isinstance(body, Mapping):
        raise invalid("body", "the request body must be a JSON object", "invalid_type")
    for name, off in _UNSUPPORTED_UNLESS.items():
        if body.get(name) not in off:
            raise invalid(name, f"'{name}' is not supported by this server yet; remove it",
                          "unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "'instructions' must be a string", "invalid_type")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store", "'store' must be a boolean", "invalid_type")
    metadata = _metadata(body.get("metadata"))
    conversation = [*history, *_messages(body.get("input"))]
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"messages": [*system, *conversation]}
    for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user"):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (response_format := _format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    chat.update(_reasoning(body.get("reasoning")))
    try:
        req = parse_chat(chat)
    except APIError as e:
        raise renamed(e) from None
    req = attrs.evolve(req, common=attrs.evolve(req.common,
                                                max_tokens_param="max_output_tokens"))
    text = body.get("text") if isinstance(body.get("text"), Mapping) else None
    echo = {"instructions": instructions, "metadata": metadata,
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": req.common.temperature, "top_p": req.common.top_p,
            "parallel_tool_calls": req.tools.parallel if req.tools else
            body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": list(body.get("tools") or []),
            "text": {"format": (text or {}).get("format") or {"type": "text"}},
            "user": body.get("user"),
            "previous_response_id": body.get("previous_response_id")}
    return ResponsesRequest(req, echo, tuple(conversation), store is not False,
                            input_items(body.get("input")))
