"""The llama.cpp backend honours allowed-token masks on the embedded model.

The backend is driven in-process on pytest's main thread with one compute thread, so that no
OpenMP team outlives the test (see test_llamacpp_backend.reference_completion), and so that
two slots fed the same prompt compute bit-identical logits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from backend_steps import llamacpp_backend

from laya_core.backend import StepItem
from laya_core.engine.allowed_tokens import NO_TOKEN_ALLOWED, AllowedTokens
from laya_core.types import Sample, SamplingParams

VOCAB = 49152
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def backend() -> Iterator[object]:
    with llamacpp_backend(n_threads=1) as b:
        yield b


@pytest.fixture(scope="module")
def digits(backend: object) -> AllowedTokens:
    """The tokens whose text is digits (with at most spaces around them)."""
    ids = [t for t in range(VOCAB)
           if backend.token_bytes(t).strip(b" ").isdigit()]  # type: ignore[attr-defined]
    assert 10 <= len(ids) < 1000
    return AllowedTokens.of(ids, VOCAB)


def generate(b: object, slot: int, params: SamplingParams, mask: AllowedTokens | None,
             n: int = 8) -> list[Sample]:
    """``n`` tokens after PROMPT on ``slot``, each sampled under ``mask``."""
    b.start_sequence(slot, params)  # type: ignore[attr-defined]
    fed = b.tokenize(PROMPT, add_special=True)  # type: ignore[attr-defined]
    start, out = 0, []
    try:
        for _ in range(n):
            result = b.step([StepItem(slot, fed, start, True,  # type: ignore[attr-defined]
                                      allowed_tokens=mask)])[0]
            assert result.error is None and result.sample is not None
            out.append(result.sample)
            start, fed = start + len(fed), [result.sample.token_id]
    finally:
        b.free_sequence(slot)  # type: ignore[attr-defined]
    return out


def ids(samples: list[Sample]) -> list[int]:
    return [s.token_id for s in samples]


def test_greedy_output_keeps_to_the_mask(backend: object, digits: AllowedTokens) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    free = ids(generate(backend, 0, greedy, None))
    held = ids(generate(backend, 0, greedy, digits))
    assert not all(digits.allows(t) for t in free)  # " Paris." unconstrained
    assert all(digits.allows(t) for t in held), held
    # A penalty puts greedy decoding into llama.cpp's sampler chain; the mask holds there too.
    penalised = SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.5)
    assert all(digits.allows(t) for t in ids(generate(backend, 1, penalised, digits)))


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_random_sampling_draws_only_allowed_tokens(backend: object, digits: AllowedTokens,
                                                   seed: int) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    drawn = ids(generate(backend, seed % 4, params, digits))
    assert all(digits.allows(t) for t in drawn), drawn
    assert len(set(drawn)) > 1  # drawn by the chain, not the arg-max that stands in for it
    truncated = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, top_k=5, top_p=0.9,
                               min_p=0.05)
    assert all(digits.allows(t) for t in ids(generate(backend, 0, truncated, digits)))


def unmasked_alternatives(b: object) -> list[tuple[int, float]]:
    """The 20 likeliest first tokens after PROMPT, with their log-probabilities."""
    first = generate(b, 1, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), None, 1)
    return list(first[0].top)


def test_log_probabilities_are_the_unmasked_models(backend: object) -> None:
    top = unmasked_alternatives(backend)
    allowed = AllowedTokens.of([top[3][0], top[7][0], top[19][0]], VOCAB)
    greedy = generate(backend, 0, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20),
                      allowed, 1)[0]
    assert greedy.token_id == top[3][0]
    assert greedy.logprob == top[3][1]  # the same computation, bit for bit
    assert list(greedy.top) == top  # the alternatives are the model's, masked ones included
    drawn_ids = set()
    for seed in range(6):
        drawn = generate(backend, 2, SamplingParams(max_tokens=1, temperature=1.0, seed=seed,
                                                    logprobs=2), allowed, 1)[0]
        assert drawn.logprob == dict(top)[drawn.token_id]
        assert list(drawn.top) == top[:2]
        drawn_ids.add(drawn.token_id)
    assert len(drawn_ids) > 1


def test_truncation_counts_the_allowed_tokens_only(backend: object) -> None:
    """Masked first, then truncated: top-k 1, or a tiny top-p, keeps the likeliest allowed
    token. Truncating first would keep the model's own favourite, which is masked."""
    top = unmasked_alternatives(backend)
    allowed = AllowedTokens.of([t for t, _ in top[1:]], VOCAB)
    for params in (SamplingParams(max_tokens=1, top_k=1, seed=7),
                   SamplingParams(max_tokens=1, top_p=0.001, seed=7),
                   SamplingParams(max_tokens=1, min_p=0.999, seed=7)):
        assert ids(generate(backend, 3, params, allowed, 1)) == [top[1][0]], params


def test_a_masked_neighbour_leaves_an_unmasked_sequence_alone(backend: object,
                                                              digits: AllowedTokens) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    alone = ids(generate(backend, 1, greedy, None, 1))
    prompt = backend.tokenize(PROMPT, add_special=True)  # type: ignore[attr-defined]
    for slot in (0, 1):
        backend.start_sequence(slot, greedy)  # type: ignore[attr-defined]
    results = backend.step([  # type: ignore[attr-defined]
        StepItem(0, prompt, 0, True, allowed_tokens=digits), StepItem(1, prompt, 0, True)])
    for slot in (0, 1):
        backend.free_sequence(slot)  # type: ignore[attr-defined]
    assert digits.allows(results[0].sample.token_id)
    assert [results[1].sample.token_id] == alone


def test_a_mask_allowing_nothing_fails_that_item_alone(backend: object) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = backend.tokenize(PROMPT, add_special=True)  # type: ignore[attr-defined]
    for slot in (0, 1):
        backend.start_sequence(slot, greedy)  # type: ignore[attr-defined]
    results = backend.step([  # type: ignore[attr-defined]
        StepItem(0, prompt, 0, True, allowed_tokens=AllowedTokens.of([], VOCAB)),
        StepItem(1, prompt, 0, True)])
    for slot in (0, 1):
        backend.free_sequence(slot)  # type: ignore[attr-defined]
    assert results[0].sample is None and results[0].error == NO_TOKEN_ALLOWED
    assert results[1].error is None and results[1].sample is not None
