"""Parsing and validating OpenAI request bodies into typed requests: the fields every
generation request shares, and completions' (chat's are in ``chat_requests.py``).

Everything is checked before any work starts; a problem names its field in ``param``.
A field that would change the output but is not implemented is refused, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from laya_core.http.errors import invalid
from laya_core.structured import formats
from laya_core.structured.spec import ConstraintSpec, GrammarError
from laya_core.structured.tools import ToolUse

# Fields that would change the output and are not implemented yet, with the value that means
# "off" (a request that sends exactly that value is fine).
_UNSUPPORTED_UNLESS = {
    "best_of": 1, "logit_bias": (None, {}), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),  # OpenAI's deprecated tools
    "use_beam_search": (None, False),
}
MAX_N = 16
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # token counts and ids reach C as int32
MAX_SEED = 2**32 - 2  # uint32, less LLAMA_DEFAULT_SEED (0xFFFFFFFF: draw a random seed)


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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; else top alternatives per token
    prompt_logprobs: int | None = None  # vLLM's: None, or top alternatives per prompt token
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Scheduling priority (vLLM's field: lower is served sooner); None: not in the body, so
    # the X-Priority header's, else 0.
    priority: int | None = None
    # The field the client limited the output with, for errors about it.
    max_tokens_param: str = "max_tokens"
    # What the output must match (response_format, structured_outputs, guided_*, tools).
    constraint: ConstraintSpec | None = None
    # False: no speculative decoding for this request, where the model has it on.
    speculative: bool = True
    # The LoRA adapter the request named as its model (generation.start sets it, and
    # ``model`` to the adapter's base model); None: the model itself.
    lora: str | None = None


@attrs.frozen
class ChatRequest:
    common: GenerationRequest
    # role and content (text; None only beside tool_calls), and for tool use: an assistant's
    # tool_calls (arguments parsed, and as sent in raw_arguments), a tool's tool_call_id.
    messages: tuple[dict[str, Any], ...]
    tools: ToolUse | None = None  # None: no tools, or tool_choice "none"
    # The last message is the assistant's unfinished turn, which the model continues (a
    # prefill): vLLM's continue_final_message, and Anthropic's final assistant message.
    continue_final: bool = False
    # More names the chat template reads: chat_template_kwargs (enable_thinking, ...) and
    # reasoning_effort.
    template_vars: Mapping[str, Any] = attrs.field(factory=dict)
    # A reasoning model's thinking budget: at most this many tokens of reasoning, then the
    # answer (None: the model's manifest default, else none).
    max_reasoning_tokens: int | None = None


@attrs.frozen
class CompletionRequest:
    common: GenerationRequest
    prompts: tuple[str | tuple[int, ...], ...]  # one choice group per prompt
    echo: bool = False


def with_header_priority(request: ChatRequest | CompletionRequest,
                         header: str | None) -> ChatRequest | CompletionRequest:
    """The request with the ``X-Priority`` header's priority where its body has none (for
    clients, or gateways in front of them, that set tiers without touching bodies)."""
    if request.common.priority is not None:
        return request
    priority = 0
    if header is not None:
        try:
            priority = int(header.strip())
        except ValueError:
            raise invalid("X-Priority", f"the X-Priority header must be an integer, got "
                          f"{header[:40]!r}") from None
        if not -INT32_MAX - 1 <= priority <= INT32_MAX:
            raise invalid("X-Priority", f"the X-Priority header must be between "
                          f"{-INT32_MAX - 1} and {INT32_MAX}, got {priority}")
    return attrs.evolve(request, common=attrs.evolve(request.common, priority=priority))


def _as_float(name: str, value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        raise invalid(name, f"'{name}' must be a finite number, got an integer too large "
                      "for a float") from None


class Body:
    """A request body's fields, each read with its type and bounds checked."""

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
            ok, value = True, _as_float(name, value)
        if not ok:
            names = " or ".join({int: "integer", float: "number", str: "string",
                                 bool: "boolean", list: "array", dict: "object"}[k] for k in kinds)
            raise invalid(name, f"'{name}' must be {names}, got {type(value).__name__}",
                          "invalid_type")
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(name, f"'{name}' must be a finite number")
        return value

    def integer(self, name: str, low: int, high: int, why: str = "") -> int | None:
        value = self.get(name, int)
        if value is not None and not low <= value <= high:
            raise invalid(name, f"'{name}' must be between {low} and {high}{why}, got {value}")
        return value  # type: ignore[no-any-return]

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


def common_fields(b: Body, logprobs: int | None, min_max_tokens: int = 1) -> GenerationRequest:
    """The fields chat and completion requests share; ``logprobs``: alternatives per output
    token, or None."""
    b.refuse_unsupported()
    model = b.get("model", str)
    if not model:
        raise invalid("model", "'model' is required: name one of GET /v1/models", "missing")
    max_tokens = b.integer("max_tokens", min_max_tokens, INT32_MAX)
    newer = b.integer("max_completion_tokens", 1, INT32_MAX)  # wins when both are sent
    max_tokens = newer if newer is not None else max_tokens
    top_k = b.integer("top_k", -1, INT32_MAX, " (-1 or 0: off)") or 0
    n = b.integer("n", 1, MAX_N) or 1
    # llama.cpp seeds are 32-bit and 4294967295 means "random"; choice i draws with seed + i.
    seed = b.integer("seed", 0, MAX_SEED - (n - 1), f" for n={n}" if n > 1 else "")
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
    stop_ids = b.get("stop_token_ids", list, [])
    if len(stop_ids) > 64 or not all(isinstance(t, int) and not isinstance(t, bool)
                                     and 0 <= t <= INT32_MAX for t in stop_ids):
        raise invalid("stop_token_ids", "'stop_token_ids' must be at most 64 token ids "
                      f"(0..{INT32_MAX})")
    prompt_logprobs = b.integer("prompt_logprobs", 0, MAX_TOP_LOGPROBS,
                                " (-1, the whole vocabulary, is not offered)")
    if prompt_logprobs is not None and stream:
        raise invalid("prompt_logprobs", "'prompt_logprobs' is not available with 'stream'; "
                      "ask for one of them")
    try:
        constraint = formats.from_body(b.body)
    except GrammarError as e:
        raise invalid(e.param, str(e)) from None
    return GenerationRequest(
        constraint=constraint, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop_token_ids=tuple(stop_ids),
        max_tokens_param="max_tokens" if newer is None else "max_completion_tokens",
        ignore_eos=b.get("ignore_eos", bool, False),
        speculative=b.get("speculative", bool, True),
        priority=b.integer("priority", -INT32_MAX - 1, INT32_MAX),
        presence_penalty=b.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=b.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=b.number("repetition_penalty", 1.0, 0.01, 10.0),
        model=model, max_tokens=max_tokens,
        temperature=b.number("temperature", 1.0, 0.0, 2.0),
        top_p=b.number("top_p", 1.0, 0.0, 1.0), top_k=max(top_k, 0),
        min_p=b.number("min_p", 0.0, 0.0, 1.0), seed=seed, stop=tuple(stop),
        stream=stream, include_usage=include_usage, user=b.get("user", str),
    )


def _prompt(value: Any, param: str) -> str | tuple[int, ...]:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    raise invalid(param, "a prompt must be a non-empty string or array of token ids",
                  "invalid_type" if value is not None else "missing")


def parse_completion(body: Any) -> CompletionRequest:
    b = Body(body)
    for name in ("tools", "tool_choice"):
        if b.body.get(name) not in (None, [], "none"):
            raise invalid(name, f"'{name}' belongs to /v1/chat/completions", "unsupported_parameter")
    top = b.get("logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("logprobs", f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    echo = b.get("echo", bool, False)
    if b.body.get("max_tokens") == 0 and not echo and type(b.body["max_tokens"]) is int:
        raise invalid("max_tokens", "'max_tokens' may be 0 only with 'echo': true (the prompt "
                      "returned, scored when 'logprobs' is set, and nothing generated)")
    # As OpenAI's legacy API: echo with max_tokens 0 returns the prompt alone.
    common = common_fields(b, top, min_max_tokens=0 if echo else 1)
    raw = b.body.get("prompt")
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        prompts = tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(raw))
    else:
        prompts = (_prompt(raw, "prompt"),)
    if len(prompts) * common.n > MAX_N:
        raise invalid("prompt", f"{len(prompts)} prompts x n={common.n} choices is more than "
                      f"{MAX_N} sequences for one request")
    if echo and common.stream:
        raise invalid("echo", "'echo' with 'stream' is not supported; ask for one of them")
    return CompletionRequest(common, prompts, echo)
