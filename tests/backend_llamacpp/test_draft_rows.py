"""The llama.cpp backend's check of a draft (``StepItem.draft``), digit for digit: the rows
of a draft the model agrees with give the samples a one-token-at-a-time decode gives; a
draft is cut at its first wrong token, whose KV is dropped, so the decode goes on as if it
had never been fed."""

from __future__ import annotations

import pytest
from backend_steps import generate, llamacpp_backend

from laya_core.backend import StepItem
from laya_core.types import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
WRONG = 2001  # a token the model does not say next here


@pytest.fixture(scope="module")
def backend():
    with llamacpp_backend(kv_unified=False, n_threads=1, flash_attn=False) as b:
        yield b


@pytest.fixture(scope="module")
def prompt(backend) -> list[int]:
    return backend.tokenize("The list: apple, banana, cherry, date, elderberry. The list "
                            "again: apple,", add_special=True)


def prefilled(b, slot: int, prompt: list[int]) -> None:
    b.start_sequence(slot, GREEDY)
    b.step([StepItem(slot, prompt[:-1], 0, False)])


def test_a_draft_the_model_agrees_with_is_kept_with_its_own_numbers(backend, prompt) -> None:
    prefilled(backend, 0, prompt)
    alone = generate(backend, 0, prompt[-1:], len(prompt) - 1, n=6)
    for k in range(1, 6):
        prefilled(backend, 1, prompt)
        draft = tuple(s.token_id for s in alone[:k])
        result = backend.step([StepItem(1, (prompt[-1], *draft), len(prompt) - 1, True,
                                        draft=draft)])[0]
        assert [result.sample, *result.accepted] == alone[:k + 1]  # logprobs and tops too
    for slot in (0, 1):
        backend.free_sequence(slot)


def test_a_draft_is_cut_at_its_first_wrong_token_and_leaves_no_kv(backend, prompt) -> None:
    prefilled(backend, 0, prompt)
    alone = generate(backend, 0, prompt[-1:], len(prompt) - 1, n=8)
    prefilled(backend, 1, prompt)
    start, last, out = len(prompt) - 1, prompt[-1], []
    # Right, right, wrong, then more: two kept, the rest dropped; and so on to the end.
    while len(out) < 8:
        right = [s.token_id for s in alone[len(out):len(out) + 2]]
        draft = (*right, WRONG, WRONG)
        result = backend.step([StepItem(1, (last, *draft), start, True, draft=draft)])[0]
        got = [result.sample, *result.accepted]
        assert len(result.accepted) == len(right)
        out += got
        start += len(got)
        last = got[-1].token_id
    assert out[:8] == alone
    for slot in (0, 1):
        backend.free_sequence(slot)
