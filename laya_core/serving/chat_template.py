"""Renders chat messages with the Jinja template stored in a model file.

The template comes from the model file, so it is untrusted: it runs in Jinja's immutable
sandbox, which refuses attribute access to internals and mutation of passed-in objects.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a request's template variables cannot set: the conversation and the model's tokens.
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})

class TemplateError(ValueError):
    """The template failed to render these messages."""


class TemplateRefusal(TemplateError):
    """The template refused these messages on purpose (``raise_exception``, e.g. roles)."""


# Used when a model file carries no template: ChatML, the most common convention.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Plain JSON, as the templates written for Hugging Face's renderer expect: Jinja's own
    ``tojson`` escapes ``<``, ``>``, ``&`` and ``'`` for HTML, which puts ``\u003c`` into
    prompts that quote tool schemas."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        # loopcontrols: {% break %} and {% continue %}, which tool-aware templates use.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source or CHATML)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the model's chat template does not parse: {e}") from e
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The whole prompt, in this process: only for templates that are trusted (tests,
        the default). The server renders model files' templates in ``TemplateSandbox``."""
        return "".join(self.generate(messages, add_generation_prompt, tools, variables))

    def generate(self, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True,
                 tools: Sequence[Any] | None = None,
                 variables: Mapping[str, Any] | None = None) -> Iterator[str]:
        """The prompt piece by piece, so a caller can stop a template that writes too much.
        ``tools``: OpenAI's tool list, for templates that render tools (else None).
        ``variables``: more names the template reads (a request's ``chat_template_kwargs``
        such as ``enable_thinking``, its ``reasoning_effort``); they cannot replace the
        messages, the tools or the special tokens."""
        globals_ = self._template.environment.globals  # range, namespace, raise_exception
        extra = {k: v for k, v in (variables or {}).items()
                 if k not in RESERVED and k not in globals_}
        pieces = self._template.generate(
            **extra,
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=self._bos, eos_token=self._eos, tools=list(tools) if tools else None)
        try:
            yield from pieces
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e
