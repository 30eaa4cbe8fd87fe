"""A reasoning model's request and output on the HTTP side: where its output starts (in a
``<think>`` block the prompt opened, or not), its thinking budget, the constraint that waits
for its reasoning to end, and the split of a whole output (laya_core/structured/reasoning.py
has the format and the streamed parser)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from laya_core.http.completion_requests import ChatRequest
from laya_core.http.errors import invalid
from laya_core.replica.client import EngineClient
from laya_core.serving.deployment import Deployment
from laya_core.structured.markup import controls_in, lark_literal
from laya_core.structured.reasoning import (
    CLOSE,
    HarmonyParser,
    ThinkParser,
    after_reasoning,
    harmony_after_reasoning,
    opened_by,
)
from laya_core.structured.spec import ConstraintSpec
from laya_core.structured.tool_formats import HARMONY_MARKUP

if TYPE_CHECKING:
    from laya_core.http.generation import Result, Running


@attrs.frozen
class Thinking:
    """A reasoning model's request: whether the prompt opened the ``<think>`` block (the
    output starts in it), closed it (no reasoning: the template's way to turn it off), and
    the thinking budget in tokens."""

    inside: bool
    closed: bool
    budget: int | None
    format: str = "think"  # or "harmony": gpt-oss's channels, read as they come
    # Harmony's markup that the model's vocabulary has as control tokens (text, id).
    controls: tuple[tuple[str, int], ...] = ()

    def parser(self) -> ThinkParser | HarmonyParser:
        if self.format == "harmony":
            return HarmonyParser()
        return ThinkParser(self.inside, self.budget)

    def grammar_needed(self, constraint: ConstraintSpec | None) -> bool:
        if constraint is not None and constraint.kind in ("tools", "tools_or_json") \
                and self.format == "harmony":  # its calls' grammar writes the channels
            return False
        return not self.closed and (constraint is not None or self.budget is not None)

    def wrap(self, constraint: ConstraintSpec | None) -> ConstraintSpec:
        """The constraint from the reasoning's end on (reasoning.after_reasoning). Its
        digit bound on JSON numbers (``numbers``) is left out: it would read the reasoning
        too."""
        if constraint is not None and constraint.convert:
            raise invalid(constraint.param, f"'{constraint.param}' (a grammar of the "
                          "request's own) cannot yet wait for a reasoning model's reasoning to "
                          "end; use a JSON schema, a regex or a choice, or set the model's "
                          'reasoning_format = "none"', "unsupported_parameter")
        inner = None if constraint is None else constraint.grammar
        if self.format == "harmony":
            grammar = harmony_after_reasoning(
                inner, self.budget, functools.partial(lark_literal, controls=self.controls))
        else:
            grammar = after_reasoning(inner, self.inside, self.budget)
        if constraint is None:
            return ConstraintSpec("grammar", grammar, "max_reasoning_tokens")
        return attrs.evolve(constraint, grammar=grammar, numbers="")


def thinking_of(deployment: Deployment, request: ChatRequest, client: EngineClient,
              prompt: Sequence[int], form: str = "think") -> Thinking:
    """Where a ``think`` model's output starts, from the prompt's last tokens; a harmony
    model's (``form``) is read from its channels."""
    budget = request.max_reasoning_tokens or deployment.models[client.model].max_reasoning_tokens
    if form == "harmony":
        if budget is not None and request.tools is not None:
            # The calls' grammar writes the channels (structured/tool_formats.py) and
            # takes no budget yet.
            raise invalid("max_reasoning_tokens", "a thinking budget is not supported "
                          "together with tools for a harmony (gpt-oss) model yet; leave "
                          "one out", "unsupported_parameter")
        return Thinking(False, False, budget, "harmony",
                        controls_in(HARMONY_MARKUP, client.tokenizer()))
    tail = client.tokenizer().decode(list(prompt[-32:]))
    inside = opened_by(tail)
    closed = not inside and tail.rstrip().endswith(CLOSE)
    return Thinking(inside, closed, None if closed else budget)


def reasoning_of(run: Running, result: Result) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output: reasoning None where the model has none.
    A budget that ended the reasoning without ``</think>`` ends it at its token."""
    parser = run.reasoning_parser()
    if parser is None:
        return None, result.text
    budget = parser.budget
    if budget and len(result.token_ids) > budget and CLOSE not in result.text:
        tokenizer = run.client.tokenizer()
        parser.feed(tokenizer.decode(result.token_ids[:budget]), budget)
        parser.feed(tokenizer.decode(result.token_ids[budget:]))
    else:
        parser.feed(result.text)
    parser.finish()
    return parser.reasoning, parser.content
