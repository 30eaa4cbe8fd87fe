"""Renders chat messages with the Jinja template stored in a model file.

The template comes from the model file, so it is untrusted: it runs in Jinja's immutable
sandbox, which refuses attribute access to internals and mutation of passed-in objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source or CHATML)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the model's chat template does not parse: {e}") from e
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True) -> str:
        """The whole prompt, in this process: only for templates that are trusted (tests,
        the default). The server renders model files' templates in ``TemplateSandbox``."""
        return "".join(self.generate(messages, add_generation_prompt))

    def generate(self, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True) -> Iterator[str]:
        """The prompt piece by piece, so a caller can stop a template that writes too much."""
        pieces = self._template.generate(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=self._bos, eos_token=self._eos)
        try:
            yield from pieces
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e
