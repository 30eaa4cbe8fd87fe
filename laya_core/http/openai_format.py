"""Shapes results and stream events into OpenAI response objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from laya_core.types import Sample

TokenBytes = Callable[[int], bytes]


def _text(token_bytes: TokenBytes, token: int) -> tuple[str, list[int]]:
    raw = token_bytes(token)
    return raw.decode("utf-8", "replace"), list(raw)


def chat_logprobs(samples: Sequence[Sample], token_bytes: TokenBytes) -> dict[str, Any]:
    content = []
    for s in samples:
        text, raw = _text(token_bytes, s.token_id)
        top = []
        for token, logprob in s.top:
            t, b = _text(token_bytes, token)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(samples: Sequence[Sample], token_bytes: TokenBytes,
                        offset: int = 0, top: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object; ``top`` cuts the alternatives listed (the prompt's
    may have been computed with more, for ``prompt_logprobs``). Each ``top_logprobs`` entry
    holds the ``top`` likeliest tokens and the chosen one: up to ``top + 1`` entries."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for s in samples:
        text, _ = _text(token_bytes, s.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        logprobs.append(s.logprob)
        alternatives = {_text(token_bytes, t)[0]: lp for t, lp in s.top[:top]}
        if s.logprob is not None:  # the chosen token is always listed, as OpenAI does
            alternatives.setdefault(text, s.logprob)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(first_token: int, prompt: Sequence[Sample], samples: Sequence[Sample],
                  token_bytes: TokenBytes, top: int) -> dict[str, Any]:
    """The legacy ``logprobs`` of an echoed completion: the prompt's tokens from offset 0
    (the first has nothing before it: null), then the generated ones."""
    out = completion_logprobs([*prompt, *samples], token_bytes, top=top)
    text, _ = _text(token_bytes, first_token)
    out["tokens"].insert(0, text)
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    out["text_offset"] = [0] + [o + len(text) for o in out["text_offset"]]
    return out


def prompt_logprobs(prompt: Sequence[Sample], token_bytes: TokenBytes,
                    top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position (the first: null) the prompt token and
    the ``top`` likeliest, keyed by token id, each with its logprob, rank and decoded text."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for s in prompt:
        entry = {str(s.token_id): {"logprob": s.logprob, "rank": s.rank,
                                   "decoded_token": _text(token_bytes, s.token_id)[0]}}
        for rank, (token, logprob) in enumerate(s.top[:top], start=1):
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank,
                                          "decoded_token": _text(token_bytes, token)[0]})
        out.append(entry)
    return out
