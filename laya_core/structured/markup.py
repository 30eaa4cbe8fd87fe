"""A format's markup where the model's vocabulary has it as control tokens.

Llama 3's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, and gpt-oss's
``<|channel|>``, ``<|message|>`` and the rest are each one control token of their models.
Such a token is not its text: the model writes the token, and the token renders as nothing
(``Tokenizer.token_bytes``). So the markup works in two places:

- a grammar writes it as the token (``<[id]>`` in llguidance's Lark), where a string
  literal would only allow the text spelt out in ordinary tokens, which the model never
  writes (:func:`lark_literal`);
- the output shows it (``SamplingParams.shown_tokens``), so that the front end's parser,
  which reads text, finds a call's trigger and a channel's header; the parser then keeps
  it from the client.

Markup that is text in a vocabulary (all of it in the embedded model's) stays text in both.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping

from laya_core.models.tokenizer import Tokenizer


@functools.lru_cache(maxsize=32)
def control_ids(tokenizer: Tokenizer) -> Mapping[str, int]:
    """Each control token of ``tokenizer`` by its text."""
    ids: dict[str, int] = {}
    for text in tokenizer.special_tokens:
        encoded = tokenizer.encode(text, add_special=False, parse_special=True)
        if len(encoded) == 1:
            ids[text] = encoded[0]
    return ids


def controls_in(markup: Iterable[str], tokenizer: Tokenizer) -> tuple[tuple[str, int], ...]:
    """The (text, id) of each piece of ``markup`` that is a control token of ``tokenizer``."""
    ids = control_ids(tokenizer)
    return tuple((text, ids[text]) for text in markup if text in ids)


def lark_literal(text: str, controls: tuple[tuple[str, int], ...] = ()) -> str:
    """``text`` as a Lark sequence: string literals, and each control token's text in it
    as that token."""
    if not any(name in text for name, _ in controls):
        return json.dumps(text)
    by_name = dict(controls)
    pattern = "|".join(re.escape(n) for n in sorted(by_name, key=len, reverse=True))
    parts = [f"<[{by_name[piece]}]>" if piece in by_name else json.dumps(piece)
             for piece in re.split(f"({pattern})", text) if piece]
    return " ".join(parts)


def shown(controls: tuple[tuple[str, int], ...]) -> tuple[tuple[int, str], ...]:
    """``SamplingParams.shown_tokens`` of ``controls``."""
    return tuple((token, text) for text, token in controls)

