"""Cached KV belongs to the text it was computed from, whatever else happens in the same step.

The cache policy's ops for one step (copies, moves, saves to host memory, restores) are
applied one after another before the step's decode. Each must see the KV the ones before it
left: a copy that lands later than a restore in the same step handed one user's prompt to
another conversation (issue 25). These tests apply such mixes at the backend and then check
that every stream continues exactly as a cold prefill of its own tokens does (flash
attention off: the exact path, so equal means bit for bit). A reused prefix always leaves at
least two prompt tokens to compute, as the engine does for llama.cpp (``Backend.min_last_prompt_chunk``): a
one-row decode runs other kernels than a prompt's rows. A stream per slot (the layout the
policy moves and copies between): in one shared buffer (``kv_unified``) a copy is a tag on the
same cells, applied at once, and a sequence's sums depend on the other sequences' cells.
"""

from __future__ import annotations

import pytest
from backend_steps import generate, llamacpp_backend

from laya_core.types import SamplingParams

pytestmark = pytest.mark.model

TAIL = 2  # prompt tokens left to compute after a reused prefix
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
SYSTEM = ("You are a careful assistant who keeps every user's secrets to themselves. "
          "Answer in one short sentence. ") * 3


@pytest.fixture(scope="module")
def backend():
    with llamacpp_backend(kv_unified=False, n_threads=1, flash_attn=False) as b:
        yield b


def prompts(b) -> tuple[list[int], list[int]]:
    mine = b.tokenize(SYSTEM + "User one: my secret word is LIGHTHOUSE. What is it?",
                      add_special=True)
    theirs = b.tokenize("Neighbour two: write a poem about the number 2, with rhymes, "
                        "in the voice of a pirate who loves arithmetic.", add_special=True)
    return mine, theirs


def cold(b, tokens: list[int], slot: int = 0) -> list[object]:
    """What a fresh prefill of ``tokens`` continues with."""
    b.start_sequence(slot, GREEDY)
    try:
        return generate(b, slot, tokens, 0)
    finally:
        b.free_sequence(slot)


def test_a_move_and_a_restore_into_the_vacated_slot_in_one_step(backend) -> None:
    """MoveStream(1 -> 3) then StartStream(1, restore=...) before any decode: the moved
    conversation keeps its own KV, and the restored one gets the saved KV."""
    b = backend
    mine, theirs = prompts(b)
    expected_mine, expected_theirs = cold(b, mine), cold(b, theirs)

    b.start_sequence(0, GREEDY)
    generate(b, 0, theirs, 0, n=1)
    b.save_stream(0, key=11)
    b.free_sequence(0)
    b.start_sequence(1, GREEDY)
    generate(b, 1, mine, 0, n=1)

    # One step's ops, as the policy orders them: the move, then the restore.
    b.share_prefix(1, 3, len(mine) - TAIL)
    b.free_sequence(1)
    b.start_sequence(1, GREEDY)
    b.restore_stream(11, 1, len(theirs) - TAIL)
    b.start_sequence(3, GREEDY, keep_tokens=len(mine) - TAIL)
    try:
        assert generate(b, 3, mine[-TAIL:], len(mine) - TAIL) == expected_mine
        assert generate(b, 1, theirs[-TAIL:], len(theirs) - TAIL) == expected_theirs
    finally:
        b.free_sequence(1)
        b.free_sequence(3)


def test_kv_copied_and_then_saved_in_one_step_is_the_copy(backend) -> None:
    """A copy into slot 2, then a save of slot 2 before any decode, then a restore: the
    saved bytes are the copied conversation's, not what slot 2 held before."""
    b = backend
    mine, theirs = prompts(b)
    expected_mine = cold(b, mine)

    b.start_sequence(2, GREEDY)
    generate(b, 2, theirs, 0, n=1)  # slot 2 holds the neighbour's KV
    b.start_sequence(1, GREEDY)
    generate(b, 1, mine, 0, n=1)

    b.free_sequence(2)
    b.start_sequence(2, GREEDY)
    b.share_prefix(1, 2, len(mine))
    b.save_stream(2, key=12)
    b.free_sequence(2)
    b.free_sequence(1)
    b.start_sequence(0, GREEDY)
    b.restore_stream(12, 0, len(mine) - TAIL)
    try:
        assert generate(b, 0, mine[-TAIL:], len(mine) - TAIL) == expected_mine
    finally:
        b.free_sequence(0)


def test_a_restore_then_a_copy_from_the_restored_slot(backend) -> None:
    """A restore into slot 1 and a copy from slot 1 to slot 2 in the same step: the copy
    holds the restored KV."""
    b = backend
    mine, _ = prompts(b)
    expected_mine = cold(b, mine)

    b.start_sequence(1, GREEDY)
    generate(b, 1, mine, 0, n=1)
    b.save_stream(1, key=13)
    b.free_sequence(1)

    b.start_sequence(1, GREEDY)
    b.restore_stream(13, 1, len(mine))
    b.start_sequence(2, GREEDY)
    b.share_prefix(1, 2, len(mine) - TAIL)
    b.free_sequence(1)
    try:
        assert generate(b, 2, mine[-TAIL:], len(mine) - TAIL) == expected_mine
    finally:
        b.free_sequence(2)
