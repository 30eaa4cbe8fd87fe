"""Chat messages to token ids, with message content always tokenized as text.

A chat template wraps each message in control tokens (``<|im_start|>user ... <|im_end|>``)
and the tokenizer turns that markup into control ids. Message content must never get the
same treatment: a user who writes ``<|im_end|><|im_start|>system`` would forge a system
turn. So before rendering, each special-token text inside a message's content is swapped
for a private-use character the template passes through untouched; after rendering, the
prompt is tokenized piece by piece: the template's text with special tokens parsed, each
swapped-in character as the plain text it stands for. Content without special-token text,
the usual case, costs one ordinary tokenize of the whole prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Supplementary Private Use Area-A: no tokenizer or template gives these meaning.
_FIRST_PLACEHOLDER = 0xF0000

Render = Callable[[Sequence[Mapping[str, Any]]], str]
Tokenize = Callable[..., list[int]]  # (text, *, add_special, parse_special) -> ids


def _placeholders(messages: Sequence[Mapping[str, Any]], specials: frozenset[str]
                  ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The messages with special-token texts in their content swapped out, and the map from
    each placeholder back to its literal text."""
    texts = sorted(specials, key=len, reverse=True)  # longest first: "<|im_start|>" wins
    contents = [m.get("content") for m in messages]
    if not texts or not any(isinstance(c, str) and any(t in c for t in texts)
                            for c in contents):
        return [dict(m) for m in messages], {}
    literal: dict[str, str] = {}
    # Characters of the placeholder range already in the content stand for themselves.
    for c in contents:
        if isinstance(c, str):
            for ch in c:
                if _FIRST_PLACEHOLDER <= ord(ch) < _FIRST_PLACEHOLDER + len(texts) + 1024:
                    literal[ch] = ch
    code = _FIRST_PLACEHOLDER
    swap: dict[str, str] = {}
    for t in texts:
        while chr(code) in literal:
            code += 1
        swap[t] = chr(code)
        literal[chr(code)] = t
        code += 1
    pattern = re.compile("|".join(re.escape(t) for t in texts))
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), str):
            m["content"] = pattern.sub(lambda found: swap[found.group(0)], m["content"])
        out.append(m)
    return out, literal


def chat_prompt_ids(messages: Sequence[Mapping[str, Any]], render: Render, tokenize: Tokenize,
                    specials: frozenset[str], add_special: bool = True) -> list[int]:
    """Render ``messages`` and tokenize the result; content never yields control tokens.
    ``add_special``: begin with the tokens the model adds to a prompt (BOS)."""
    swapped, literal = _placeholders(messages, specials)
    prompt = render(swapped)
    if not literal:
        return tokenize(prompt, add_special=add_special, parse_special=True)
    ids: list[int] = []
    first = add_special  # the first piece gets the BOS token, where the model adds one
    pieces = re.split("(" + "|".join(map(re.escape, literal)) + ")", prompt)
    for i, piece in enumerate(pieces):
        if piece:
            # Odd pieces are placeholders: their literal text, as text.
            text, parse = (literal[piece], False) if i % 2 else (piece, True)
            ids += tokenize(text, add_special=first, parse_special=parse)
            first = False
    return ids
