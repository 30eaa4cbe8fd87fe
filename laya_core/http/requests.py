"""Parsing and validating OpenAI request bodies into typed requests.

Everything is checked before any work starts; a problem names its field in ``param``.
A field that would change the output but is not implemented is refused, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from laya_core.http.errors import invalid

# Fields that would change the output and are not implemented yet, with the value that means
# "off" (a request that sends exactly that value is fine).
_UNSUPPORTED_UNLESS = {
    "n": 1, "best_of": 1, "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "echo": False, "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
}


@attrs.frozen
class GenerationRequest:
    """What both endpoints share once validated."""

    model: str
    max_tokens: int | None  # None: as many as fit in max_seq_len
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None


@attrs.frozen
class ChatRequest:
    common: GenerationRequest
    messages: tuple[dict[str, str], ...]


@attrs.frozen
class CompletionRequest:
    common: GenerationRequest
    prompt: str | list[int]


class _Body:
    def __init__(self, body: Any) -> None:
        if not isinstance(body, Mapping):
            raise invalid("body", "the request body must be a JSON object", "invalid_type")
        self.body = body

    def get(self, name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            names = " or ".join({int: "integer", float: "number", str: "string",
                                 bool: "boolean", list: "array", dict: "object"}[k] for k in kinds)
            raise invalid(name, f"'{name}' must be {names}, got {type(value).__name__}",
                          "invalid_type")
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(name, f"'{name}' must be a finite number")
        return value

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self.get(name, float, default)
        if not low <= value <= high:
            raise invalid(name, f"'{name}' must be between {low:g} and {high:g}, got {value:g}")
        return float(value)

    def refuse_unsupported(self) -> None:
        for name, off in _UNSUPPORTED_UNLESS.items():
            if name not in self.body:
                continue
            allowed = off if isinstance(off, tuple) else (None, off)
            if self.body[name] not in allowed:
                raise invalid(name, f"'{name}' is not supported by this server yet; remove it "
                              "or send its default", "unsupported_parameter")


def _common(b: _Body) -> GenerationRequest:
    b.refuse_unsupported()
    model = b.get("model", str)
    if not model:
        raise invalid("model", "'model' is required: name one of GET /v1/models", "missing")
    max_tokens = b.get("max_completion_tokens", int) or b.get("max_tokens", int)
    param = "max_completion_tokens" if "max_completion_tokens" in b.body else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(param, f"'{param}' must be at least 1, got {max_tokens}")
    top_k = b.get("top_k", int, 0)
    if top_k < -1:
        raise invalid("top_k", f"'top_k' must be -1 (off), 0 (off) or positive, got {top_k}")
    seed = b.get("seed", int)
    stop = b.get("stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "'stop' must be a non-empty string or a list of at most 16 of them")
    options = b.get("stream_options", dict, {})
    stream = b.get("stream", bool, False)
    if options and not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "'include_usage' must be a boolean",
                      "invalid_type")
    return GenerationRequest(
        model=model, max_tokens=max_tokens,
        temperature=b.number("temperature", 1.0, 0.0, 2.0),
        top_p=b.number("top_p", 1.0, 0.0, 1.0), top_k=max(top_k, 0),
        min_p=b.number("min_p", 0.0, 0.0, 1.0), seed=seed, stop=tuple(stop),
        stream=stream, include_usage=include_usage, user=b.get("user", str),
    )


_ROLES = ("system", "user", "assistant", "developer")


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


def parse_chat(body: Any) -> ChatRequest:
    b = _Body(body)
    common = _common(b)
    raw = b.get("messages", list)
    if not raw:
        raise invalid("messages", "'messages' must be a non-empty array of messages", "missing")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise invalid(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"messages[{i}].role",
                          f"role must be one of {', '.join(_ROLES)}, got {role!r}")
        if m.get("content") is None:
            raise invalid(f"messages[{i}].content", "message content is required", "missing")
        text = _content_text(m["content"], f"messages[{i}].content")
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return ChatRequest(common, tuple(messages))


def parse_completion(body: Any) -> CompletionRequest:
    b = _Body(body)
    common = _common(b)
    prompt = b.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return CompletionRequest(common, list(prompt))
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", "'prompt' must be a non-empty string or array of token ids",
                      "invalid_type" if prompt is not None else "missing")
    return CompletionRequest(common, prompt)
