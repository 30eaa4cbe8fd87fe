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
                        offset: int = 0) -> dict[str, Any]:
    tokens, logprobs, tops, offsets = [], [], [], []
    for s in samples:
        text, _ = _text(token_bytes, s.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        logprobs.append(s.logprob)
        tops.append({_text(token_bytes, t)[0]: lp for t, lp in s.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}
