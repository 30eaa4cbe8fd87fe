"""Prefix matching shared by the cache policies: how long a known beginning is, and the rules
for reusing one (long enough to be worth it, two prompt tokens always left to compute)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MIN_REUSE_TOKENS = 16  # shorter matches are not worth the copy
MIN_TAIL_TOKENS = 2  # prompt tokens a reuse leaves to compute


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case for a conversation: one slice compare
        return n
    low, high = 0, n  # a[:low] == b[:low] holds, a[:high] == b[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


def best_match(prompt: Sequence[int],
               candidates: Iterable[tuple[int, Sequence[int]]]) -> tuple[int, int] | None:
    """(key, tokens to reuse) of the ``(key, tokens)`` candidate sharing the longest prefix
    with ``prompt``.

    At least two prompt tokens are always left to compute: one gives the logits to sample
    the first new token from, and a last chunk of a single token takes other kernel paths
    than the longer chunk the first answer came from (see ``Sequence.tokens_to_compute``).
    """
    best: tuple[int, int] | None = None
    limit = len(prompt) - MIN_TAIL_TOKENS
    for key, tokens in candidates:
        n = min(common_prefix_len(prompt, tokens), limit)
        if n >= MIN_REUSE_TOKENS and (best is None or n > best[1]):
            best = (key, n)
    return best
