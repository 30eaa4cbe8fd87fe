"""A constraint's masks along a draft (speculative decoding under structured output): the
mask of each row a drafted step samples, computed ahead without moving the sequence's own
matchers, and cut where the draft leaves the grammar. Byte tokens (the toy tokenizer), so a
token is a character."""

from __future__ import annotations

import pytest
from toy_backend import END, ToyTokenizer

from laya_core.backend import ModelInfo, StepItem
from laya_core.engine.allowed_tokens import AllowedTokens, looks_ahead
from laya_core.structured import formats
from laya_core.structured.compiler import GrammarCompiler

INFO = ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                 chat_template=None, bos_token="", eos_token="", add_bos=False)
SCHEMA = formats.json_schema({"type": "object", "properties": {
    "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"],
    "additionalProperties": False}, "schema")
TEXT = '{"name": "keeper", "n": 12}'


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ToyTokenizer(), INFO)


def tokens(text: str) -> list[int]:
    return list(text.encode())


def step_by_step(compiler: GrammarCompiler, text: str) -> list[AllowedTokens]:
    """The masks a sequence asks for one token at a time: after each prefix of ``text``."""
    constraint = compiler.constraint(SCHEMA)
    out = []
    for i in range(len(text) + 1):
        mask = constraint(tokens(text[:i]))
        assert mask is not None
        out.append(mask)
    return out


def same(a: AllowedTokens | None, b: AllowedTokens | None) -> bool:
    assert a is not None and b is not None
    return bool((a.to_bools() == b.to_bools()).all())


def test_the_masks_along_a_draft_are_those_of_each_token_in_turn(compiler) -> None:
    want = step_by_step(compiler, TEXT)
    constraint = compiler.constraint(SCHEMA)
    for start in (0, 5, 12, len(TEXT) - 3):
        draft = tokens(TEXT[start:start + 6])
        masks = constraint.along(tokens(TEXT[:start]), draft)
        assert len(masks) == len(draft) + 1
        assert all(same(m, w) for m, w in zip(masks, want[start:], strict=False))


def test_the_sequences_own_matchers_do_not_move(compiler) -> None:
    """After a look ahead, the next plain call answers as if there had been none, whether the
    model kept all of the draft, part of it or none; also past the grammar's end, where a
    stopped matcher takes an end token as nothing (rolling that back would undo the "}")."""
    want = step_by_step(compiler, TEXT)
    for kept in (0, 2, 6):
        constraint = compiler.constraint(SCHEMA)
        constraint.along(tokens(TEXT[:9]), tokens(TEXT[9:15]))
        assert same(constraint(tokens(TEXT[:9 + kept])), want[9 + kept])
    constraint = compiler.constraint(SCHEMA)
    end = constraint.along(tokens(TEXT), [END, ord("x")])
    assert len(end) == 2  # the end is allowed there; nothing follows it
    assert same(constraint(tokens(TEXT)), want[-1])
    assert constraint.is_accepting


def test_a_draft_is_cut_at_its_first_token_the_grammar_refuses(compiler) -> None:
    constraint = compiler.constraint(SCHEMA)
    # '"n": "12"' where the schema wants an integer: cut before the quote.
    masks = constraint.along(tokens('{"name": "keeper", "n": '), tokens('"12"}'))
    assert len(masks) == 1
    masks = constraint.along(tokens('{"name": "keeper", "n": '), tokens('12"}'))
    assert len(masks) == 3  # "1" and "2" are checked; the quote is not
    assert not masks[2].allows(ord('"')) and masks[2].allows(ord("}"))


def test_a_plain_callable_cannot_look_ahead(compiler) -> None:
    """A constraint without ``along`` (a plugin's callable) does not look ahead, so its
    sequence decodes without drafts; structured output's matchers do."""
    constraint = compiler.constraint(SCHEMA)
    assert looks_ahead(constraint) and not looks_ahead(constraint.__call__)


def test_a_step_item_holds_one_mask_a_draft_token_or_none() -> None:
    mask = AllowedTokens.of([1, 2], 257)
    StepItem(0, [5, 6, 7], 3, True, draft=(6, 7), draft_allowed=(mask, None))
    assert StepItem(0, [5, 6, 7], 3, True, draft=(6, 7)).draft_masks == (None, None)
    with pytest.raises(ValueError, match="one a draft token"):
        StepItem(0, [5, 6, 7], 3, True, draft=(6, 7), draft_allowed=(mask,))
