"""A reasoning model's output split into its reasoning and its answer.

Models of the ``<think>`` family (DeepSeek-R1, Qwen3, QwQ and their distillations) write
their reasoning between ``<think>`` and ``</think>``, then the answer. Some chat templates
open the block themselves at the end of the generation prompt (DeepSeek-R1's ends with
``<think>\\n``), so the output starts inside it; others leave the model to write
``<think>``; Qwen3's template, asked for no thinking (``enable_thinking = false``), writes an
empty block into the prompt. :class:`ThinkParser` handles the three: told whether the prompt
left a block open, it reads the output as it streams, in pieces of any size, and says which
text is reasoning and which is the answer, holding back only what may be the start of a tag.

gpt-oss writes in harmony's channels: its reasoning in the ``analysis`` channel, its answer
in ``final``, its tool calls in ``commentary`` (:class:`HarmonyParser`).

The format is the model's chat template's (:func:`detect`), or the manifest's
``reasoning_format`` (``"auto"``, ``"think"``, ``"harmony"`` or ``"none"``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from laya_core.structured.call_parts import partial_suffix

REASONING_FORMATS = ("auto", "think", "harmony", "none")
OPEN, CLOSE = "<think>", "</think>"


@functools.lru_cache(maxsize=64)  # asked for each chat request: a template is read once
def detect(template: str | None) -> str:
    """The reasoning format a chat template shows: "think", "harmony" or "none"."""
    if template and "<|channel|>" in template and "analysis" in template:
        return "harmony"
    return "think" if template and OPEN in template and CLOSE in template else "none"


def reasoning_format(template: str | None, override: str = "auto") -> str:
    """``override`` unless "auto"; else what the template shows."""
    if override not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning format {override!r}; the formats are: "
                         + ", ".join(REASONING_FORMATS))
    return detect(template) if override == "auto" else override


def opened_by(prompt_text: str | None) -> bool:
    """Whether a rendered prompt leaves a ``<think>`` block open for the output."""
    if not prompt_text:
        return False
    last_open = prompt_text.rfind(OPEN)
    return last_open >= 0 and last_open > prompt_text.rfind(CLOSE)


class _Split:
    """What both parsers keep: the reasoning and the answer so far, and the tokens the
    model wrote inside its reasoning (``reasoning_tokens``: those of each fed piece that
    began, stayed in or ended the reasoning and gave no answer text; the usage objects'
    ``reasoning_tokens``)."""

    reasoning: str
    content: str
    state: str
    reasoning_tokens: int = 0
    _reasoning_states: tuple[str, ...] = ()

    def feed(self, text: str, tokens: int = 0,
             head: Callable[[int], str] | None = None) -> list[tuple[str, str]]:
        """The next piece of text (``tokens``: how many tokens it came in) as ``(kind,
        text)`` pairs, kind ``"reasoning"`` or ``"content"``. ``head(n)``: the text of the
        piece's first n tokens, for a piece of several tokens (a speculative step's, held
        ones) in which a thinking budget ends: what precedes the budget's end is reasoning,
        what follows it is not, as :func:`laya_core.http.thinking.reasoning_of` splits a
        whole output."""
        cut = self._cut_at(tokens)
        if cut and head is not None:
            first = head(cut)
            if first and len(first) < len(text) and text.startswith(first):
                return self.feed(first, cut) + self.feed(text[len(first):], tokens - cut)
        before = self.state
        out = self._feed(text, tokens)
        kinds = {kind for kind, _ in out}
        if tokens and "content" not in kinds and (
                "reasoning" in kinds or before in self._reasoning_states
                or self.state in self._reasoning_states):
            self.reasoning_tokens += tokens
        return out

    def _feed(self, text: str, tokens: int) -> list[tuple[str, str]]:
        raise NotImplementedError

    def _cut_at(self, tokens: int) -> int:
        """How many of a piece's ``tokens`` precede a thinking budget's end inside it;
        0 where none ends inside it."""
        return 0

    def _say(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


class ThinkParser(_Split):
    """The ``<think>`` family's output, streamed; see the module docstring.

    :meth:`feed` takes the next piece of text and returns ``(kind, text)`` pairs, kind
    ``"reasoning"`` or ``"content"``; :meth:`finish` returns what was held back. The answer's
    first line breaks after ``</think>`` are dropped, as the templates write them."""

    def __init__(self, inside: bool = False, budget: int | None = None) -> None:
        # A thinking budget (after_reasoning's): the reasoning ends after that many tokens
        # even without </think>, which may then open the answer.
        self.budget = budget
        self.spent = 0
        self.cut = False  # the budget ended the reasoning
        # "start": nothing seen yet (a block may open); "opened": just inside one;
        # "reasoning"; "after": just past its end; "content".
        self.state = "opened" if inside else "start"
        self.held = ""
        self.reasoning = ""  # all of it, for the whole answer
        self.content = ""

    _reasoning_states = ("opened", "reasoning")

    def _cut_at(self, tokens: int) -> int:
        if not self.budget or self.state not in self._reasoning_states:
            return 0
        left = self.budget - self.spent
        return left if 0 < left < tokens else 0

    def _feed(self, text: str, tokens: int) -> list[tuple[str, str]]:
        """``tokens`` count against the budget."""
        out: list[tuple[str, str]] = []
        text, self.held = self.held + text, ""
        if self.budget and self.state in ("opened", "reasoning") and tokens:
            self.spent += tokens
            if self.spent >= self.budget and CLOSE not in text:  # all of it is reasoning
                if self.state == "opened":
                    text = text.lstrip("\n")
                self._say(out, "reasoning", text)
                self.state, self.cut = "after", True
                return out
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state = "opened"
                    text = stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):  # maybe the tag, not yet whole
                    self.held = text
                    break
                self.state = "content"
                continue
            if self.state == "opened":  # the line breaks that follow <think>
                text = text.lstrip("\n")
                if not text:
                    break
                self.state = "reasoning"
                continue
            if self.state == "reasoning":
                end = text.find(CLOSE)
                if end >= 0:
                    self._say(out, "reasoning", text[:end])
                    self.state = "after"
                    text = text[end + len(CLOSE):]
                    continue
                keep = partial_suffix(text, CLOSE)
                self._say(out, "reasoning", text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            if self.state == "after":  # the line breaks between the block and the answer
                text = text.lstrip("\n")
                if self.cut and text and CLOSE.startswith(text):  # the tag, late: held
                    self.held = text
                    break
                if self.cut and text.startswith(CLOSE):
                    text = text[len(CLOSE):]
                    self.cut = False
                    continue
                if not text:
                    break
                self.state, self.cut = "content", False
                continue
            self._say(out, "content", text)
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back: a tag that never completed is text of its part."""
        held, self.held = self.held, ""
        if not held:
            return []
        out: list[tuple[str, str]] = []
        self._say(out, "reasoning" if self.state in ("opened", "reasoning") else "content",
                  held)
        return out



def split(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    parser = ThinkParser(inside)
    parser.feed(text)
    parser.finish()
    return parser.reasoning, parser.content



def after_reasoning(grammar: str | None, inside: bool, budget: int | None) -> str:
    """llguidance grammar text that lets a ``<think>`` block come first and then holds the
    output to ``grammar`` (None: any text). ``inside``: the prompt opened the block, so the
    output starts in it; else the model may open one. ``budget``: at most that many tokens
    of reasoning; then the answer begins (an optional ``</think>`` first), and the parser
    (``ThinkParser(budget=)``) ends the reasoning there. ``grammar`` is llguidance's JSON
    form (``{"grammars": [...]}``) or Lark text.

    The reasoning is one lexeme that ends at ``</think>`` and includes it (llguidance's
    ``suffix``): a plain ``/(.|\n)*/`` before a ``"</think>"`` literal would match the tag
    itself, and the lexer, which takes the longest match, would never leave it."""
    attributes = [f'suffix="{CLOSE}"'] + ([f"max_tokens={budget}"] if budget else [])
    rules = [f"thought[{', '.join(attributes)}]: /(.|\\n)*/",
             f'gap: "{CLOSE}"? /\\n*/' if budget else "gap: /\\n*/"]
    block = "thought gap" if inside else f'("{OPEN}" thought gap)?'
    return _then_answer(block, rules, grammar)


def _then_answer(before: str, rules: list[str], grammar: str | None) -> str:
    """llguidance grammar text: ``before`` (a rule body, with ``rules``), then the output
    held to ``grammar`` (None: any text), which may be Lark or llguidance's JSON form."""
    if grammar is None:
        rules.append("answer: /(.|\\n)*/")
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(
            [f"start: {before} answer", *rules])}]})
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {
        "grammars": [{"lark_grammar": grammar}]}
    inner = [dict(g) for g in top["grammars"]]
    name = inner[0].setdefault("name", "laya_answer")
    wrapper = {"lark_grammar": "\n".join([f"start: {before} @{name}", *rules])}
    return json.dumps({**top, "grammars": [wrapper, *inner]})


def harmony_body(lit: Callable[[str], str], budget: int | None = None) -> tuple[str, str]:
    """A harmony message's body up to its ``<|end|>``, as (the expression, its ``body`` rule),
    of at most ``budget`` tokens. ``lit`` writes the markup, as control tokens where the
    vocabulary has them (structured/markup.py).

    Where ``<|end|>`` is a token, free text cannot hold it, and the token ends the body.
    Where it is text, the body is one lexeme that ends at it and includes it (llguidance's
    ``suffix``, as :func:`after_reasoning`'s); a body the budget cut then ends at the next
    ``<|start|>`` (:class:`HarmonyParser` reads either)."""
    end = lit("<|end|>")
    token = end.startswith("<[")
    attributes = ([] if token else [f"suffix={json.dumps('<|end|>')}"]) \
        + ([f"max_tokens={budget}"] if budget else [])
    listed = f"[{', '.join(attributes)}]" if attributes else ""
    return (f"body {end}" if token else "body"), f"body{listed}: /(.|\\n)*/"


def harmony_after_reasoning(grammar: str | None, budget: int | None,
                            lit: Callable[[str], str]) -> str:
    """llguidance grammar text for gpt-oss, asked for no tools: its ``analysis`` messages
    first (with ``budget``, one of at most that many tokens: then its end, and the final
    channel, are written for it), then the ``final`` channel's message held to ``grammar``
    (None: any text)."""
    body, rule = harmony_body(lit, budget)
    message = (f"({lit('<|channel|>')} {lit('analysis')} {lit('<|message|>')} {body} "
               f"{lit(_START)})")
    final = f"{lit('<|channel|>')} {lit('final')} {lit('<|message|>')}"
    return _then_answer(f"{message}{'?' if budget else '*'} {final}", [rule], grammar)


_START, _CHANNEL, _MESSAGE = "<|start|>assistant", "<|channel|>", "<|message|>"
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_BODY_ENDS = (*_ENDS, _START)  # a body the thinking budget cut ends where the next begins


class HarmonyParser(_Split):
    """gpt-oss's output in harmony's channels, streamed, with :class:`ThinkParser`'s
    interface: an ``analysis`` message is reasoning, a ``final`` one the answer (their
    markup left out), and any other channel's message (``commentary``: tool calls, or a
    preamble) is passed on whole, markup and all, as answer text for the tool-call parser.
    Text outside any channel is the answer."""

    budget: int | None = None  # a harmony budget is the grammar's (harmony_after_reasoning)

    def __init__(self) -> None:
        self.state = "between"  # or "analysis", "final", "other" (in a body), "plain"
        self.held = ""
        self.reasoning = ""
        self.content = ""

    _reasoning_states = ("analysis",)

    def _feed(self, text: str, tokens: int) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        text, self.held = self.held + text, ""
        while text:
            if self.state == "plain":
                self._say(out, "content", text)
                break
            if self.state == "between":
                if text.startswith(_START):
                    text = text[len(_START):]
                    continue
                if text.startswith(_CHANNEL):
                    head = text.find(_MESSAGE)
                    if head < 0:  # the header is not whole yet
                        self.held = text
                        break
                    name = text[len(_CHANNEL):head].lstrip()
                    if name.startswith("analysis"):
                        self.state = "analysis"
                    elif name.startswith("final"):
                        self.state = "final"
                    else:
                        self.state = "other"
                        self._say(out, "content", text[:head + len(_MESSAGE)])
                    text = text[head + len(_MESSAGE):]
                    continue
                if any(m.startswith(text) for m in (_START, _CHANNEL)):
                    self.held = text
                    break
                self.state = "plain"
                continue
            kind = "reasoning" if self.state == "analysis" else "content"
            ends = [(text.find(e), e) for e in _BODY_ENDS if e in text]
            if ends:
                at, end = min(ends)
                closed = end in _ENDS  # else the next message begins (a budget's cut)
                self._say(out, kind, text[:at] + (end if closed and self.state == "other"
                                                  else ""))
                self.state = "between"
                text = text[at + len(end) if closed else at:]
                continue
            keep = max(partial_suffix(text, e) for e in _BODY_ENDS)
            self._say(out, kind, text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        out: list[tuple[str, str]] = []
        if held:  # in a body, its end; else markup cut short, which is text then
            self._say(out, "reasoning" if self.state == "analysis" else "content", held)
        return out


ReasoningParser = ThinkParser | HarmonyParser
