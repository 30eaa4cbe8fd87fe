"""The block size and the hash chain over full blocks, shared by the KV cache and the router.

A prompt is cut into blocks of :data:`BLOCK_SIZE` tokens. The hash of block ``i`` covers its
tokens and every token before it, so two prompts share hash ``i`` exactly when they share
tokens ``[0, (i + 1) * BLOCK_SIZE)``. The KV manager (``kv/pool.py``) indexes cached blocks by
this hash, and the router (``routing/router.py``) routes a prompt by the same hashes, so a
block the router routes by is a block a replica's index may hold.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_SIZE = 16  # tokens per KV block, and per hashed prompt block


def cache_salt(lora: str | None, unloads: int = 0) -> int | None:
    """Where a sequence's hash chain starts: None for the base model; for a LoRA adapter, a
    digest of its name, so that no block's KV is shared between the base model and an
    adapter or between two adapters (the same tokens give other K and V through each), and
    of how often that name was unloaded, so that an adapter loaded again under the name
    never finds its predecessor's KV."""
    if lora is None:
        return None
    tail = b"" if not unloads else b"\0" + str(unloads).encode()
    digest = hashlib.blake2b(b"lora\0" + lora.encode() + tail, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def prefix_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_SIZE, max_blocks: int | None = 32,
    salt: int | None = None,
) -> tuple[int, ...]:
    """Cumulative hashes of the leading full blocks of a tokenized prompt, for ``route(prefix=)``.

    Hash ``i`` covers tokens ``[0, (i + 1) * block_size)``, so two prompts share hash ``i``
    exactly when they share those tokens. Hashes are 64-bit BLAKE2b digests (unsigned ints), the
    same in every process and on every platform (unlike ``hash()`` of a str). A partial last
    block is left out, as the KV cache only reuses full blocks. ``max_blocks`` (32 x 16 = 512
    tokens by default) is enough to tell conversations apart; each hash costs the router a table
    update per request. About 0.8 µs per block. ``salt``: :func:`cache_salt`'s.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    num_bytes = 4 * block_size  # tokens are packed as little-endian uint32
    data = _pack(token_ids[: num_blocks * block_size])
    digest, hashes = b"" if salt is None else salt.to_bytes(8, "little"), []
    for start in range(0, len(data), num_bytes):
        # Chaining the previous digest makes hash i depend on every block before it.
        digest = hashlib.blake2b(digest + data[start : start + num_bytes], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
    return tuple(hashes)


def next_block_hash(previous: int | None, block: Sequence[int]) -> int:
    """The hash of ``block`` following the block hashed ``previous`` (None: the first block).

    The same chain as :func:`prefix_hashes`, one block at a time: the KV manager hashes a
    sequence's blocks as they fill, and a block it caches has the hash the router routes by.
    """
    digest = b"" if previous is None else previous.to_bytes(8, "little")
    digest = hashlib.blake2b(digest + _pack(block), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
