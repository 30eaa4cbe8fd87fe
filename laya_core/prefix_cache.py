"""Which KV the cache already holds, so a new prompt can skip prefilling its known beginning.

Finished sequences keep their KV in their slot until the room is needed (least recently used
goes first); running sequences can lend theirs too. Pure bookkeeping: the engine asks the
backend to share or keep the cells.
"""

from __future__ import annotations

import collections
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


class PrefixCache:
    """Retained slots of finished sequences, in least-recently-used order."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

    def __contains__(self, slot: int) -> bool:
        return slot in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def retain(self, slot: int, tokens: list[int]) -> None:
        self._entries[slot] = tokens

    def take(self, slot: int) -> list[int]:
        return self._entries.pop(slot)

    def num_tokens(self, slot: int) -> int:
        return len(self._entries[slot])

    def touch(self, slot: int) -> None:
        """Mark a retained slot as just used, so it is evicted last."""
        self._entries.move_to_end(slot)

    def slots(self) -> list[int]:
        """Retained slots, least recently used first."""
        return list(self._entries)

    def entries(self) -> Iterable[tuple[int, list[int]]]:
        return self._entries.items()


def best_match(prompt: Sequence[int],
               candidates: Iterable[tuple[int, Sequence[int]]]) -> tuple[int, int] | None:
    """(slot, tokens to reuse) of the candidate sharing the longest prefix with ``prompt``.

    At least two prompt tokens are always left to compute: one gives the logits to sample
    the first new token from, and a last chunk of a single token takes other kernel paths
    than the longer chunk the first answer came from (see ``Sequence.tokens_to_compute``).
    """
    best: tuple[int, int] | None = None
    limit = len(prompt) - MIN_TAIL_TOKENS
    for slot, tokens in candidates:
        n = min(common_prefix_len(prompt, tokens), limit)
        if n >= MIN_REUSE_TOKENS and (best is None or n > best[1]):
            best = (slot, n)
    return best
