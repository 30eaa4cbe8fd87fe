"""The <think> family's output split into reasoning and answer, at every split point."""

from __future__ import annotations

from pathlib import Path

import pytest

from laya_core.structured.reasoning import HarmonyParser, ThinkParser, detect, opened_by, split

CASES = [  # (output, the prompt left a block open, reasoning, content)
    ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", False, "First, 2 + 2.\n", "It is 4."),
    ("First, 2 + 2.\n</think>\n\nIt is 4.", True, "First, 2 + 2.\n", "It is 4."),
    ("It is 4.", False, "", "It is 4."),
    ("  <think>a < b, so</think>b", False, "a < b, so", "b"),
    ("<think>cut short, no end", False, "cut short, no end", ""),
    ("ends on a partial </thi", True, "ends on a partial </thi", ""),
    ("<thinking is not the tag", False, "", "<thinking is not the tag"),
    ("<thi", False, "", "<thi"),
    ("<think></think>only the answer, 1 < 2", False, "", "only the answer, 1 < 2"),
]


@pytest.mark.parametrize(("output", "inside", "reasoning", "content"), CASES)
def test_whole_and_streamed_at_every_split_point(output: str, inside: bool, reasoning: str,
                                                 content: str) -> None:
    assert split(output, inside) == (reasoning, content)
    for cut in range(len(output) + 1):
        parser = ThinkParser(inside)
        pieces = parser.feed(output[:cut]) + parser.feed(output[cut:]) + parser.finish()
        assert "".join(t for k, t in pieces if k == "reasoning") == reasoning, cut
        assert "".join(t for k, t in pieces if k == "content") == content, cut
    parser = ThinkParser(inside)  # a character at a time
    pieces = [p for ch in output for p in parser.feed(ch)] + parser.finish()
    assert "".join(t for k, t in pieces if k == "content") == content


def test_the_published_reasoning_template_is_detected() -> None:
    folder = Path(__file__).parents[2] / "chat_templates"
    found = {p.stem for p in folder.glob("*.jinja") if detect(p.read_text()) == "think"}
    assert found == {"deepseek_r1"}


def test_the_template_and_the_prompt_say_where_the_output_starts() -> None:
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}...</think>"
    assert detect(qwen3) == "think" and detect("{{ messages }}") == "none"
    assert opened_by("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1's prompt
    assert not opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # no thinking
    assert not opened_by("<think>old</think> answer<|im_start|>assistant\n")
    assert not opened_by(None)


def test_a_spent_budget_ends_the_reasoning_without_the_tag() -> None:
    """after_reasoning's grammar ends the reasoning after ``budget`` tokens; the answer may
    then start with a late ``</think>``, which is no part of it."""
    for late in ("", "</think>", "</think>\n\n"):
        parser = ThinkParser(inside=True, budget=3)
        pieces = parser.feed("one", 1) + parser.feed(" two", 1) + parser.feed(" three", 1)
        for part in (late, '{"a": 1}'):
            pieces += parser.feed(part, 1) if part else []
        pieces += parser.finish()
        assert parser.reasoning == "one two three", late
        assert parser.content == '{"a": 1}', late
    early = ThinkParser(inside=True, budget=5)  # ended by its tag before the budget
    early.feed("a", 1), early.feed("</think>", 1), early.feed("b", 1), early.finish()
    assert (early.reasoning, early.content) == ("a", "b")


def test_a_budget_ending_inside_a_piece_of_several_tokens_splits_it_there() -> None:
    """A speculative step, or held tokens, hand over several tokens at once; where the
    thinking budget ends among them, the tokens before its end are reasoning and the rest
    the answer, as the whole output splits (``reasoning_of``), and the usage counts only
    those before it as reasoning."""
    tokens = ["one", " two", " three", '{"a"', ": 1}"]
    for sizes in ([1, 1, 1, 1, 1], [2, 3], [1, 4], [5], [3, 2], [2, 1, 2]):
        parser, at = ThinkParser(inside=True, budget=3), 0
        pieces = []
        for n in sizes:
            piece = tokens[at:at + n]
            pieces += parser.feed("".join(piece), n,
                                  lambda k, piece=piece: "".join(piece[:k]))
            at += n
        pieces += parser.finish()
        assert (parser.reasoning, parser.content) == ("one two three", '{"a": 1}'), sizes
        assert parser.reasoning_tokens == 3, sizes
    blind = ThinkParser(inside=True, budget=3)  # no head: the piece stays on one side
    blind.feed("one two", 2), blind.feed(' three{"a"', 2), blind.finish()
    assert (blind.reasoning, blind.content) == ('one two three{"a"', "")


HARMONY = [  # (output, reasoning, answer)
    ("<|channel|>analysis<|message|>7 has no divisors.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Yes, 7 is prime.<|return|>",
     "7 has no divisors.", "Yes, 7 is prime."),
    ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
     "<|call|>", "Look it up.",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city":"Paris"}<|call|>'),
    ("Just text, no channels.", "", "Just text, no channels."),
    ("<|channel|>analysis<|message|>cut short", "cut short", ""),
    ("<|channel|>commentary to=functions.get", "", "<|channel|>commentary to=functions.get"),
    # A thinking budget cut the analysis: the grammar went on at the next message.
    ("<|channel|>analysis<|message|>Is 7 a<|start|>assistant<|channel|>final<|message|>no",
     "Is 7 a", "no"),
]


@pytest.mark.parametrize(("output", "reasoning", "content"), HARMONY)
def test_harmony_channels_at_every_split_point(output: str, reasoning: str,
                                               content: str) -> None:
    for cut in range(len(output) + 1):
        parser = HarmonyParser()
        pieces = parser.feed(output[:cut]) + parser.feed(output[cut:]) + parser.finish()
        assert "".join(t for k, t in pieces if k == "reasoning") == reasoning, cut
        assert "".join(t for k, t in pieces if k == "content") == content, cut
    assert detect((Path(__file__).parents[2] / "chat_templates" / "harmony.jinja")
                  .read_text()) == "harmony"
