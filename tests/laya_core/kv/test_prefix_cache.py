"""Prefix reuse on the paged layout: matching, and the engine end to end with the paged toy.

The streams layout's retained slots are the llama.cpp plugin's
(tests/backend_llamacpp/test_streams_cache.py)."""

from __future__ import annotations

from toy_backend import follow_up_conversation, shared_prefix_workload, started_engine

from laya_core.kv.prefix import MIN_REUSE_TOKENS, best_match, common_prefix_len


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(777), -1]) == 777


def test_best_match_leaves_two_tokens_and_ignores_short_matches() -> None:
    prompt = list(range(40))
    assert best_match(prompt, [(0, list(range(10))), (1, list(range(30)))]) == (1, 30)
    assert best_match(prompt, [(0, list(range(100)))]) == (0, 38)  # a last chunk of 2
    assert best_match(prompt, [(0, list(range(MIN_REUSE_TOKENS - 1)))]) is None


def test_engine_reuses_a_conversation_prefix_with_the_toy_backend() -> None:
    engine = started_engine(max_seq_len=256, max_num_seqs=2)
    history, follow_up = follow_up_conversation(engine)
    # Whole blocks of 16 are reused: 48 of the 56 tokens of history.
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == 48
    assert engine.prefix_queried_tokens == len(history) + len(follow_up)


def test_many_requests_sharing_prefixes_all_get_exact_outputs() -> None:
    """More requests than slots, sharing a system prompt and repeating questions, so that
    running sequences share blocks and cached blocks are reused and evicted; the paged
    toy reads every step's history through block tables, and repeats its prompt, so any
    wrong KV shows."""
    engine = started_engine(max_seq_len=256, max_num_seqs=4, max_step_tokens=48,
                            options={"step_delay_s": 0.001})
    shared_prefix_workload(engine)
    assert engine.prefix_hits > 40
    assert engine.kv_used_tokens == 0 and engine.kv_cached_tokens > 0
