"""Prefix matching shared by the cache policies: how long a known beginning is, and the rules
for reusing one (long enough to be worth it, the prompt's last chunk always left to compute)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MIN_REUSE_TOKENS = 16  # shorter matches are not worth the copy


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case for a conversation: one slice compare
        return n
    low, high = 0, n  # a[:low] == b[:low] holds, a[:high] == b[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


def best_match(prompt: Sequence[int], candidates: Iterable[tuple[int, Sequence[int]]],
               min_tail: int = 1) -> tuple[int, int] | None:
    """(key, tokens to reuse) of the ``(key, tokens)`` candidate sharing the longest prefix
    with ``prompt``.

    At least ``min_tail`` prompt tokens are always left to compute
    (``Request.min_last_chunk``): one gives the logits to sample the first new token from,
    and a backend whose one-token batch takes other kernel paths than the longer chunk the
    first answer came from asks for more (see ``Request.tokens_to_compute``).
    """
    best: tuple[int, int] | None = None
    limit = len(prompt) - max(1, min_tail)
    for key, tokens in candidates:
        n = min(common_prefix_len(prompt, tokens), limit)
        if n >= MIN_REUSE_TOKENS and (best is None or n > best[1]):
            best = (key, n)
    return best
