"""The block hash chain the router routes by and the KV cache indexes by."""

from __future__ import annotations

import pytest

from laya_core.kv.hashing import BLOCK_SIZE, next_block_hash, prefix_hashes


def test_prefix_hashes_are_cumulative_over_full_blocks() -> None:
    a = prefix_hashes([*range(32), 7, 8, 9], block_size=16)  # the partial third block is left out
    b = prefix_hashes([*range(16), *range(100, 116)], block_size=16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert prefix_hashes([*range(33)], block_size=16) == a


def test_prefix_hashes_are_pinned_across_processes_and_platforms() -> None:
    # BLAKE2b of little-endian uint32 tokens: these values must never change.
    assert prefix_hashes(list(range(40)), block_size=16) == (
        3502644936733289510,
        12397679246499735564,
    )


def test_prefix_hashes_fit_in_64_bits_and_stop_at_max_blocks() -> None:
    hashes = prefix_hashes(list(range(1000)), block_size=4, max_blocks=10)
    assert len(hashes) == 10 and all(0 <= h < 2**64 for h in hashes)
    assert len(prefix_hashes(list(range(1000)), block_size=4, max_blocks=None)) == 250
    assert prefix_hashes([1, 2, 3], block_size=4) == ()


@pytest.mark.parametrize(("tokens", "block_size"), [([1] * 16, 0), ([-1] * 16, 16),
                                                   ([2**32] * 16, 16)])
def test_prefix_hashes_reject_bad_input(tokens: list[int], block_size: int) -> None:
    with pytest.raises(ValueError):
        prefix_hashes(tokens, block_size=block_size)


def test_next_block_hash_continues_the_prefix_chain() -> None:
    tokens = list(range(3 * BLOCK_SIZE))
    chain: list[int] = []
    for start in range(0, len(tokens), BLOCK_SIZE):
        chain.append(next_block_hash(chain[-1] if chain else None, tokens[start:start + BLOCK_SIZE]))
    assert tuple(chain) == prefix_hashes(tokens)
