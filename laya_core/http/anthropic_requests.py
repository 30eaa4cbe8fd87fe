"""Parsing a ``POST /v1/messages`` (or ``/v1/messages/count_tokens``) body: Anthropic's Messages
request checked and translated into the chat request it means (:func:`parse_messages`).

The translation is the whole difference: the request then runs exactly as a chat completion
(same template, same sampling), so greedy output equals ``/v1/chat/completions``'. A field
that would change the output and is not implemented (server tools, image or document
blocks: the models served are text-only) is refused with a 400 naming it, never ignored.
``thinking`` reaches a reasoning model as its template's ``enable_thinking`` and its
thinking budget; past thinking blocks stay out of the prompt. A final assistant message is a prefill: the answer continues its text (the chat
request's ``continue_final``). Results, stream events and errors are shaped back by
:mod:`laya_core.http.anthropic_format`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from laya_core.http.chat_requests import parse_chat
from laya_core.http.completion_requests import ChatRequest
from laya_core.http.errors import APIError, invalid

# Fields that do not change the output here (prompt caching is automatic: the prefix cache),
# accepted and left aside.
_IGNORED = frozenset({"cache_control", "service_tier", "inference_geo", "speed", "diagnostics",
                      "user_profile_id", "workspace_id"})
# The fields of a Messages request; any other is refused (Anthropic refuses them too).
_CREATE_FIELDS = _IGNORED | {
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "metadata", "tools", "tool_choice", "thinking", "output_config"}
_COUNT_FIELDS = _IGNORED | {"model", "messages", "system", "tools", "tool_choice", "thinking",
                            "output_config"}
_TEXT_ONLY = ("image", "document", "search_result", "container_upload")
# Where a chat field's error names the Messages field it came from.
_PARAMS = ((re.compile(r"^stop$"), "stop_sequences"),
           (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
           (re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
           (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
           (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"))


def renamed(e: APIError) -> APIError:
    """``e`` with a chat field in ``param`` named as the Messages field it came from."""
    if e.param:
        for pattern, name in _PARAMS:
            if pattern.match(e.param):
                e.param = pattern.sub(name, e.param)
                break
    return e


def _text_only(kind: str, param: str) -> APIError:
    return invalid(param, f"{kind} blocks are not supported: the models this server runs are "
                   "text-only; send the content as text", "unsupported_content")


def _texts(content: Any, param: str) -> str:
    """The text of a string or of a list of text blocks (``system``, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, "must be a string or an array of text blocks", "invalid_type")
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind in _TEXT_ONLY:
            raise _text_only(kind, f"{param}[{j}]")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{param}[{j}]", 'must be a text block {"type": "text", "text": ...}',
                          "invalid_type")
        parts.append(block["text"])
    return "".join(parts)


def _blocks(content: Any, param: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(param, "must be a string or an array of content blocks", "invalid_type")
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise invalid(f"{param}[{j}]", "each content block must be an object with a "
                          "'type'", "invalid_type")
    return content


def _text_of(block: Mapping[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise invalid(f"{at}.text", "a text block needs 'text', a string", "missing")
    return block["text"]


def _user(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn as chat messages: a tool message per tool_result, then the text."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, param)):
        at, kind = f"{param}[{j}]", block["type"]
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{at}.tool_use_id", "a tool_result needs the 'tool_use_id' of "
                              "the tool_use it answers", "missing")
            result = _texts(block.get("content") or "", f"{at}.content")
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise invalid(f"{at}.is_error", "must be a boolean", "invalid_type")
            if is_error:  # templates have no field for it: the model reads it in the text
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind in _TEXT_ONLY:
            raise _text_only(kind, at)
        elif kind == "tool_use":
            raise invalid(at, "tool_use blocks belong in assistant messages")
        else:
            raise invalid(f"{at}.type", f"content blocks of type {kind!r} are not supported "
                          "by this server", "unsupported_content")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(content: Any, param: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, param)):
        at, kind = f"{param}[{j}]", block["type"]
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise invalid(at, "a tool_use block needs 'id' and 'name', strings", "missing")
            if not isinstance(args, Mapping):
                raise invalid(f"{at}.input", "must be an object", "invalid_type")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": dict(args)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # past thinking stays out of the prompt, as chat templates leave it
        elif kind in _TEXT_ONLY:
            raise _text_only(kind, at)
        else:
            raise invalid(f"{at}.type", f"content blocks of type {kind!r} are not supported "
                          "in assistant messages by this server", "unsupported_content")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
        out["content"] = out["content"] or None
    return out


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _texts(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "must be a non-empty array of messages",
                      "missing" if raw is None else "invalid_type")
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise invalid(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if "content" not in m:
            raise invalid(f"messages[{i}].content", "Field required", "missing")
        if role == "user":
            out += _user(m["content"], f"messages[{i}].content")
        elif role == "assistant":
            out.append(_assistant(m["content"], f"messages[{i}].content"))
        else:
            raise invalid(f"messages[{i}].role", f"must be 'user' or 'assistant', got {role!r}")
    if raw[-1].get("role") == "assistant" and out[-1].get("tool_calls"):
        raise invalid(f"messages[{len(raw) - 1}].content", "a final assistant message (a "
                      "prefill the model continues) must be text; a tool_use block ends a turn")
    return out


def _tools(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    raw = body.get("tools")
    if raw is None:
        tools: list[Any] = []
    elif not isinstance(raw, list):
        raise invalid("tools", "must be an array of tools", "invalid_type")
    else:
        tools = raw
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise invalid(f"tools[{i}]", "each tool must be an object", "invalid_type")
        if tool.get("type", "custom") != "custom":
            raise invalid(f"tools[{i}].type", f"tools of type {tool.get('type')!r} (server "
                          "tools) are not supported by this server; send client tools with "
                          "'name' and 'input_schema'", "unsupported_parameter")
        if "input_schema" not in tool:
            raise invalid(f"tools[{i}].input_schema", "Field required", "missing")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    if out:
        chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name", "a tool_choice of type 'tool' names the tool",
                          "missing")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "must be a boolean",
                      "invalid_type")
    if disable and kind != "none":
        chat["parallel_tool_calls"] = False


def _thinking(value: Any) -> dict[str, Any]:
    """``thinking``: enabled (with its ``budget_tokens``, the thinking budget) or disabled,
    as the chat template's ``enable_thinking`` (Qwen3's name; a template without it is as
    it was)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind != "enabled":
        raise invalid("thinking", 'must be {"type": "enabled", "budget_tokens": N} or '
                      '{"type": "disabled"}')
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise invalid("thinking.budget_tokens", "must be an integer of at least 1")
    return {"chat_template_kwargs": {"enable_thinking": True}, "max_reasoning_tokens": budget}


def _check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise invalid(name, "this field is not supported by this server (Extra inputs "
                          "are not permitted)", "unsupported_parameter")
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise invalid("output_config", "must be an object", "invalid_type")
        for name, value in config.items():
            if value is not None:
                raise invalid(f"output_config.{name}", "is not supported by this server yet; "
                              "remove it", "unsupported_parameter")


def parse_messages(body: Any, count_only: bool = False) -> ChatRequest:
    """A Messages (or, ``count_only``, a count_tokens) body as the chat request it means."""
    if not isinstance(body, Mapping):
        raise invalid("body", "the request body must be a JSON object", "invalid_type")
    _check_fields(body, _COUNT_FIELDS if count_only else _CREATE_FIELDS)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    if chat["messages"][-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["continue_final_message"] = True
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise invalid("max_tokens", "Field required", "missing")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid("max_tokens", "must be an integer of at least 1")
        chat["max_tokens"] = max_tokens
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
                and not 0 <= temperature <= 1:
            raise invalid("temperature", f"must be between 0 and 1, got {temperature}")
        for name in ("temperature", "top_p", "top_k", "stream"):
            if body.get(name) is not None:
                chat[name] = body[name]
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list):
                raise invalid("stop_sequences", "must be an array of strings", "invalid_type")
            if stops:
                chat["stop"] = stops
        metadata = body.get("metadata")
        if metadata is not None:
            if not isinstance(metadata, Mapping) or not isinstance(
                    metadata.get("user_id", ""), (str, type(None))):
                raise invalid("metadata", "must be an object; 'user_id' a string",
                              "invalid_type")
            if metadata.get("user_id"):
                chat["user"] = metadata["user_id"]
    _tools(body, chat)
    chat.update(_thinking(body.get("thinking")))
    try:
        return parse_chat(chat)
    except APIError as e:
        if e.param == "continue_final_message":
            e.param = f"messages[{len(body['messages']) - 1}]"
        raise renamed(e) from None
