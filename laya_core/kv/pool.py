"""The paged KV manager: a fixed pool of blocks, block tables, and a prefix index.

The pool holds ``num_blocks`` blocks of ``block_size`` tokens, sized by the memory plan and
fixed at load. Each sequence holds a block table (block ids for positions ``0 ..``), and each
block a reference count: a block of a cached prefix may sit in many tables at once.

A *full* block whose KV is computed gets a hash that covers its tokens and every token
before it (``kv/hashing.py``: the chain the router's ``prefix_hashes`` uses, so a block
the router routes by is a block this index holds). The index maps hash -> block. A
block no sequence holds keeps its KV and its hash until its room is needed: such blocks are
evicted least recently used first, and only after the blocks that hold nothing. So free
blocks, not the number of sequences, limit how many prefixes stay cached.

Pure bookkeeping, imports no model library: the backend reads the block tables.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from laya_core.kv.hashing import BLOCK_SIZE, next_block_hash


class KVManager:
    """Blocks of the KV pool, per sequence; check with ``can_*`` before the action."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._index: dict[int, int] = {}  # block hash -> the block holding that KV
        self._empty = list(range(num_blocks - 1, -1, -1))  # free, holding nothing; pop() = 0
        # Free blocks that hold cached KV, least recently used first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._tables: dict[int, list[int]] = {}  # sequence id -> block table
        self._hashes: dict[int, list[int]] = {}  # sequence id -> hashes of its leading blocks
        self._salts: dict[int, int] = {}  # sequence id -> where its hash chain starts

    # -- counts -------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: empty, or cached and evictable."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks that at least one sequence holds."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds that keep a cached prefix's KV (given back when needed)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    # -- the prefix index ---------------------------------------------------------------

    def cached_blocks(self, token_ids: Sequence[int], max_tokens: int,
                      salt: int | None = None) -> list[int]:
        """The cached blocks holding the longest known beginning of ``token_ids``, at most
        ``max_tokens`` tokens of it (whole blocks only); ``salt``: where the hash chain
        starts (hashing.cache_salt: a LoRA adapter's blocks are apart)."""
        found: list[int] = []
        digest: int | None = salt
        bs = self.block_size
        for start in range(0, min(max_tokens, len(token_ids)) - bs + 1, bs):
            digest = next_block_hash(digest, token_ids[start:start + bs])
            block = self._index.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def num_cached_tokens(self, token_ids: Sequence[int], max_tokens: int) -> int:
        """Tokens of ``token_ids``' beginning whose KV the pool holds (see ``cached_blocks``)."""
        return len(self.cached_blocks(token_ids, max_tokens)) * self.block_size

    # -- sequences ----------------------------------------------------------------------

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int,
                     max_reuse_tokens: int = 0, salt: int | None = None) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now, reusing what is cached of
        the first ``max_reuse_tokens`` of ``token_ids``."""
        hits = self.cached_blocks(token_ids, max_reuse_tokens, salt)
        num_evictable_hits = sum(1 for b in hits if self._ref[b] == 0)
        needed = self.blocks_for(num_tokens) - len(hits)
        return needed <= self.num_free_blocks - num_evictable_hits

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                 max_reuse_tokens: int = 0, salt: int | None = None) -> int:
        """Give ``seq_id`` a block table for ``num_tokens`` tokens; returns how many leading
        tokens of ``token_ids`` it found cached (their KV is in its first blocks). ``salt``
        starts its hash chain (``cached_blocks``)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(token_ids, num_tokens, max_reuse_tokens, salt):
            raise MemoryError(f"sequence {seq_id} needs {self.blocks_for(num_tokens)} blocks, "
                              f"{self.num_free_blocks} free")
        hits = self.cached_blocks(token_ids, max_reuse_tokens, salt)
        for block in hits:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        table = hits + [self._take() for _ in range(self.blocks_for(num_tokens) - len(hits))]
        self._tables[seq_id] = table
        self._hashes[seq_id] = [self._hash[b] for b in hits]  # type: ignore[misc]
        if salt is not None:
            self._salts[seq_id] = salt
        return len(hits) * self.block_size

    def num_indexed_blocks(self, seq_id: int) -> int:
        """Leading blocks of ``seq_id`` already hashed (``cache_blocks`` starts after them)."""
        return len(self._hashes[seq_id])

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def cache_blocks(self, seq_id: int, computed_token_ids: Sequence[int]) -> None:
        """Index the full blocks of ``seq_id`` whose KV is now computed.

        ``computed_token_ids`` are the sequence's tokens whose KV is in its blocks. A block
        whose KV another block already holds stays out of the index (the first one serves).
        """
        hashes, table, bs = self._hashes[seq_id], self._tables[seq_id], self.block_size
        for i in range(len(hashes), len(computed_token_ids) // bs):
            digest = next_block_hash(hashes[-1] if hashes else self._salts.get(seq_id),
                                     computed_token_ids[i * bs:(i + 1) * bs])
            hashes.append(digest)
            if digest not in self._index:
                self._index[digest] = table[i]
                self._hash[table[i]] = digest

    def free(self, seq_id: int) -> None:
        """Give back ``seq_id``'s blocks; those that hold cached KV stay cached until needed.

        The table is released tail first, so a sequence's last blocks are evicted before its
        first ones, which more prompts share. Freeing an unknown sequence does nothing.
        """
        self._hashes.pop(seq_id, None)
        self._salts.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._hash[block] is None:
                self._empty.append(block)
            else:
                self._evictable[block] = None

    def _take(self) -> int:
        """A block for new KV: an empty one, else the least recently used cached one."""
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            digest = self._hash[block]
            assert digest is not None
            del self._index[digest]
            self._hash[block] = None
        self._ref[block] = 1
        return block
