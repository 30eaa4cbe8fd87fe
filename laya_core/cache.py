"""KV-cache accounting: the contract for cache policies and the default block policy.

The KV pool of a replica is fixed when it starts; a cache policy decides whether a sequence may
hold part of it. The engine never asks a backend to compute a token for which the policy has
not granted room, so load cannot grow the pool.
"""

from __future__ import annotations

import abc
import math


class CacheFullError(Exception):
    """A sequence asked for more KV cache than is free."""


class CachePolicy(abc.ABC):
    """Accounts KV cache, in tokens rounded up to blocks, per sequence."""

    def __init__(self, num_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_tokens < block_size:
            raise ValueError(f"a KV pool of {num_tokens} tokens is smaller than one block")
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    @abc.abstractmethod
    def num_used_blocks(self) -> int:
        """Blocks held by live sequences."""

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 to 1.0."""
        return self.num_used_blocks / self.num_blocks

    def can_ever_hold(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    @abc.abstractmethod
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now."""

    @abc.abstractmethod
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Reserve room for ``num_tokens`` tokens of sequence ``seq_id``."""

    @abc.abstractmethod
    def free(self, seq_id: int) -> None:
        """Give back everything ``seq_id`` holds; freeing an unknown sequence does nothing."""


class BlockCachePolicy(CachePolicy):
    """Reserves each sequence's worst case (prompt + max_tokens) in whole blocks at admission.

    Reserving up front means a running sequence never has to be preempted for room.
    """

    def __init__(self, num_tokens: int, block_size: int = 16) -> None:
        super().__init__(num_tokens, block_size)
        self._blocks_of: dict[int, int] = {}
        self._num_used = 0

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if seq_id in self._blocks_of:
            raise ValueError(f"sequence {seq_id} already holds cache")
        if not self.can_allocate(num_tokens):
            raise CacheFullError(
                f"sequence {seq_id} needs {self.blocks_for(num_tokens)} blocks, "
                f"{self.num_free_blocks} free"
            )
        blocks = self.blocks_for(num_tokens)
        self._blocks_of[seq_id] = blocks
        self._num_used += blocks

    def free(self, seq_id: int) -> None:
        self._num_used -= self._blocks_of.pop(seq_id, 0)
