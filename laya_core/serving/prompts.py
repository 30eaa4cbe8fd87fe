"""Chat prompts of a deployment's models: rendering in the template sandbox, tokenizing, and
the test render each model's chat template must pass before the model serves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from laya_core.backend import ModelInfo
from laya_core.replica.client import EngineClient
from laya_core.serving.chat_prompt import chat_prompt_ids
from laya_core.serving.chat_template import TemplateError, TemplateRefusal
from laya_core.serving.template_sandbox import TemplateSandbox
from laya_core.structured.tools import ToolUse, prompt_messages

# Conversations a model's chat template must render at load: the first it accepts passes.
# Some templates refuse a system turn or a leading assistant on purpose (raise_exception).
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi."},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}),
    ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Bye."}),
    ({"role": "user", "content": "Hi."},),
)


class ChatPrompts:
    """The deployment's chat templates, rendered in one sandbox (a child process)."""

    def __init__(self) -> None:
        self.sandbox = TemplateSandbox()

    def close(self) -> None:
        self.sandbox.close()

    def render(self, info: ModelInfo, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The model's chat template applied to ``messages``, in the sandbox. Blocks for
        up to the sandbox's time limit: call it from a worker thread."""
        return self.sandbox.render(info.chat_template, info.bos_token, info.eos_token,
                                   messages, add_generation_prompt, tools, variables)

    def prompt_ids(self, client: EngineClient, messages: Sequence[Mapping[str, Any]],
                   add_generation_prompt: bool = True, add_special: bool = True,
                   tools: ToolUse | None = None,
                   variables: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a chat: the template's markup as special tokens, the messages'
        content as text; tools and tool calls as the template renders them, else in the
        generic format (laya_core/structured/tools.py). Blocking (rendering and
        tokenizing): call it from a worker thread."""
        info = client.info().model_info
        tokenizer = client.tokenizer()
        messages, tool_list = prompt_messages(messages, tools, info.chat_template)
        return chat_prompt_ids(
            messages, lambda m: self.render(info, m, add_generation_prompt, tool_list,
                                            variables),
            tokenizer.encode, tokenizer.special_tokens, add_special)

    def probe(self, info: ModelInfo) -> None:
        """Refuse a model whose chat template cannot render a plain conversation within the
        sandbox's bounds; runs once the model has loaded, before it serves."""
        refusals = []
        for probe in PROBES:
            try:
                self.render(info, probe)
                return
            except TemplateRefusal as e:
                refusals.append(str(e))
            except TemplateError as e:
                raise TemplateError(f"the model's chat template failed a test render: {e}") \
                    from None
        raise TemplateError("the model's chat template refused every test conversation: "
                            + "; ".join(refusals))
