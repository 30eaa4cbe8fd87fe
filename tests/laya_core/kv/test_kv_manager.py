"""The paged KV manager: block tables, reference counts, the prefix index and its eviction."""

from __future__ import annotations

import random

import pytest

from laya_core.kv.hashing import BLOCK_SIZE, prefix_hashes
from laya_core.kv.pool import KVManager


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run(kv: KVManager, seq_id: int, prompt: list[int], total: int | None = None) -> int:
    """Allocate a sequence, compute its prompt, return the tokens it found cached."""
    hit = kv.allocate(seq_id, prompt, total or len(prompt), max_reuse_tokens=len(prompt) - 2)
    kv.cache_blocks(seq_id, prompt)
    return hit


def test_a_table_covers_the_tokens_asked_for_and_free_gives_them_back() -> None:
    kv = KVManager(8)
    assert kv.allocate(1, tokens(20), 40) == 0
    assert len(kv.block_table(1)) == 3 and kv.num_used_blocks == 3
    assert len(set(kv.block_table(1))) == 3
    kv.free(1)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 8 and kv.num_cached_blocks == 0
    kv.free(1)  # unknown: nothing
    with pytest.raises(KeyError):
        kv.block_table(1)


def test_check_and_act_agree_and_allocating_past_the_pool_raises() -> None:
    kv = KVManager(4)
    assert kv.can_allocate([], 64) and not kv.can_allocate([], 65)
    assert kv.can_ever_hold(64) and not kv.can_ever_hold(65)
    kv.allocate(1, [], 48)
    assert not kv.can_allocate([], 17)
    with pytest.raises(MemoryError):
        kv.allocate(2, [], 17)
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate(1, [], 1)


def test_a_later_prompt_shares_the_full_blocks_of_a_finished_one() -> None:
    kv = KVManager(16)
    first = tokens(40)
    run(kv, 1, first, 48)
    table = kv.block_table(1)
    kv.free(1)
    assert kv.num_cached_blocks == 2  # 40 tokens: two full blocks; the partial one is not
    second = [*first, 7, 8, 9]
    assert run(kv, 2, second, 60) == 32
    assert kv.block_table(2)[:2] == table[:2]
    assert kv.num_cached_blocks == 0 and kv.num_used_blocks == 4


def test_running_sequences_share_blocks_and_reference_counts_hold_them() -> None:
    kv = KVManager(16)
    prompt = tokens(50)
    run(kv, 1, prompt)
    assert run(kv, 2, prompt) == 48  # two tokens are always left to compute
    shared = kv.block_table(1)[:3]
    assert kv.block_table(2)[:3] == shared and kv.num_used_blocks == 5
    kv.free(1)
    assert kv.num_used_blocks == 4 and kv.num_cached_blocks == 0  # 2 still holds them
    kv.free(2)
    assert kv.num_cached_blocks == 3


def test_reuse_is_limited_to_whole_blocks_and_to_max_reuse_tokens() -> None:
    kv = KVManager(16)
    run(kv, 1, tokens(64))
    kv.free(1)
    assert kv.num_cached_tokens(tokens(64), 62) == 48
    assert kv.num_cached_tokens(tokens(64), 64) == 64
    assert kv.num_cached_tokens(tokens(64), 15) == 0
    assert kv.num_cached_tokens([*tokens(20), 999, *tokens(40, 21)], 60) == 16
    assert kv.allocate(2, tokens(64), 64, max_reuse_tokens=0) == 0  # e.g. prompt logprobs


def test_block_hashes_are_the_routers_prefix_hashes() -> None:
    kv = KVManager(16)
    prompt = [random.Random(1).randrange(49152) for _ in range(70)]
    run(kv, 1, prompt)
    table = kv.block_table(1)
    assert [kv._hash[b] for b in table[:4]] == list(prefix_hashes(prompt, BLOCK_SIZE, None))
    assert kv._hash[table[4]] is None  # partial


def test_empty_blocks_go_before_cached_ones_and_cached_ones_least_recent_first() -> None:
    kv = KVManager(6)
    a, b = tokens(32, 0), tokens(32, 1000)
    run(kv, 1, a)
    kv.free(1)
    run(kv, 2, b)
    kv.free(2)
    assert kv.num_cached_blocks == 4
    kv.allocate(3, [], 32)  # the two empty blocks: both prefixes stay
    assert kv.num_cached_tokens(a, 32) == 32 and kv.num_cached_tokens(b, 32) == 32
    kv.free(3)
    assert run(kv, 4, [*a, 5, 6]) == 32  # a is now the most recently used
    kv.free(4)
    kv.allocate(5, [], 48)  # needs 3: two empty, then b's least recent block (its tail)
    assert kv.num_cached_tokens(a, 32) == 32 and kv.num_cached_tokens(b, 32) == 16


def test_a_block_computed_twice_is_indexed_once() -> None:
    kv = KVManager(8)
    prompt = tokens(32)
    kv.allocate(1, prompt, 32)
    kv.allocate(2, prompt, 32)  # both before either computed: nothing to share yet
    kv.cache_blocks(1, prompt)
    kv.cache_blocks(2, prompt)
    kv.free(1)
    kv.free(2)
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 8
    assert kv.cached_blocks(prompt, 32) == list(kv._index.values())


def test_decoded_tokens_fill_blocks_that_are_cached_too() -> None:
    kv = KVManager(8)
    prompt = tokens(10)
    kv.allocate(1, prompt, 40)
    kv.cache_blocks(1, prompt)
    answer = [*prompt, *tokens(25, 500)]
    kv.cache_blocks(1, answer[:20])
    kv.cache_blocks(1, answer)
    kv.free(1)
    assert kv.num_cached_tokens([*answer, 1, 2], 40) == 32


def test_free_blocks_not_sequences_limit_the_cached_conversations() -> None:
    kv = KVManager(1024)  # 16,384 tokens, as in the measurement of issue 13
    rng = random.Random(7)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(340, 367))]
               for _ in range(12)]
    for i, p in enumerate(prompts):
        run(kv, i, p, len(p) + 64)
        kv.free(i)
    for i, p in enumerate(prompts):
        assert run(kv, 100 + i, p, len(p) + 64) == (len(p) - 2) // 16 * 16
        kv.free(100 + i)


def test_a_random_workload_keeps_the_counts_consistent() -> None:
    kv = KVManager(40)
    rng = random.Random(3)
    bases = [tokens(64, 1000 * i) for i in range(5)]
    live: dict[int, list[int]] = {}
    for seq_id in range(500):
        if live and (rng.random() < 0.5 or len(live) > 4):
            gone = rng.choice(list(live))
            kv.free(gone)
            del live[gone]
        prompt = rng.choice(bases)[:rng.randrange(2, 64)] + tokens(rng.randrange(0, 30))
        total = len(prompt) + rng.randrange(1, 40)
        if kv.can_allocate(prompt, total, len(prompt) - 2):
            hit = run(kv, seq_id, prompt, total)
            assert hit % 16 == 0 and hit <= len(prompt) - 2
            live[seq_id] = prompt
        held = {b for s in live for b in kv.block_table(s)}
        assert kv.num_used_blocks == len(held)
        assert all(kv._ref[b] == sum(b in kv.block_table(s) for s in live) for b in held)
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        assert all(kv._hash[b] == h for h, b in kv._index.items())


def test_an_adapters_blocks_are_apart_from_the_base_models_and_each_others() -> None:
    """The same tokens under another LoRA adapter (``cache_salt``) find nothing cached, and
    an adapter's own blocks hash as the router's salted prefix hashes say."""
    from laya_core.kv.hashing import cache_salt

    kv = KVManager(num_blocks=32)
    prompt = tokens(4 * BLOCK_SIZE)
    salts = [None, cache_salt("pirate"), cache_salt("poet")]
    assert len(set(salts)) == 3 and cache_salt(None) is None
    for seq_id, salt in enumerate(salts):
        assert kv.num_cached_tokens(prompt, len(prompt)) == (0 if seq_id == 0 else 64)
        assert kv.allocate(seq_id, prompt, len(prompt) + 1, len(prompt), salt) == 0
        kv.cache_blocks(seq_id, prompt)
        kv.free(seq_id)
    for salt in salts:  # each finds its own blocks again
        assert kv.cached_blocks(prompt, len(prompt), salt) != []
        assert len(kv.cached_blocks(prompt, len(prompt), salt)) == 4
    pirate = kv.cached_blocks(prompt, len(prompt), salts[1])
    assert set(pirate).isdisjoint(kv.cached_blocks(prompt, len(prompt), None))
    routed = prefix_hashes(prompt, BLOCK_SIZE, salt=salts[1])
    assert [kv._hash[b] for b in pirate] == list(routed)
