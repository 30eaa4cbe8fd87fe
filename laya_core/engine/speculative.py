"""Speculative decoding by prompt lookup: drafts a decoding sequence's next tokens from its
own text, for the model to check in one step.

The sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up among its earlier tokens, prompt and output alike; the
tokens that followed their latest earlier occurrence are the draft. While the text goes on
copying the stretch the last draft came from (its last ``prompt_lookup_max`` tokens are the
ones before the same place there), the draft continues that stretch instead: in text that
repeats itself the latest occurrence of a short n-gram is often another line than the one
being copied. The backend feeds the
last token and the draft together and samples row after row with the sequence's own sampler,
stopping at the first row whose token is not the draft's next one (``StepItem.draft``). A
draft is one token for certain (its probability is 1), so "sample from the model's
distribution and keep the draft token when they agree" is exactly rejection sampling: the
output has the model's distribution, and a seeded request draws one random number per output
token, as it does without a draft.

Drafting backs off where drafts keep failing. A draft is as long as the last one that was
kept whole, doubled (up to ``num_speculative_tokens``), or one token longer than what was
kept of the last one; and each draft rejected outright doubles the steps the sequence then
decodes without one (up to ``MAX_PAUSE``), until a token is kept again. Text with nothing to
copy then costs a lookup a token and now and then a one-token check, not a long wasted
verification a step: each drafted row costs a backend's row of compute (on llama.cpp almost
a whole decode's, docs/benchmarks.md).
"""

from __future__ import annotations

import attrs

from laya_core.types import SpeculativeConfig

MAX_PAUSE = 32  # steps without a draft, at most, after drafts failed one after another
# What a drafter holds per token of its sequence: its reference in the drafter's copy of the
# tokens, and per n-gram size an index entry (a tuple and a dict slot). Measured with
# tracemalloc: 391 B a token for sizes 2-4 (peak 442), 916 for sizes 1-8 (8,192 tokens).
DRAFT_BYTES_PER_TOKEN = 16
DRAFT_BYTES_PER_NGRAM = 150


def drafts_at(config: SpeculativeConfig, batch: int) -> bool:
    """Whether a step that runs ``batch`` sequences drafts (``disable_by_batch_size``): a
    check's extra rows cost little beside one sequence's decode, which reads the weights for
    one row, and nearly a row's compute each beside a batch that already fills the cores."""
    return config.disable_by_batch_size is None or batch <= config.disable_by_batch_size


def drafter_bytes_per_token(config: SpeculativeConfig) -> int:
    """The memory a drafter takes per token of its sequence, for the memory plan."""
    sizes = config.prompt_lookup_max - config.prompt_lookup_min + 1
    return DRAFT_BYTES_PER_TOKEN + DRAFT_BYTES_PER_NGRAM * sizes


@attrs.define
class SpeculativeStats:
    """Counts since the replica started, vLLM's spec_decode series under ``laya:``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class NgramDrafter:
    """One sequence's prompt-lookup drafts. It keeps the sequence's tokens (prompt and
    output) and an index of their n-grams, both grown as the output grows, so a draft costs
    a few dictionary operations a token, not a scan of the text."""

    def __init__(self, config: SpeculativeConfig, prompt: list[int]) -> None:
        self.config = config
        self._tokens = list(prompt)
        self._num_prompt = len(prompt)
        # n-gram -> the index just after its latest occurrence that is indexed.
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _index
        self._pause = 0  # steps left without a draft
        self._failures = 0  # drafts rejected outright, one after another
        self._length = config.num_speculative_tokens  # the next draft's length, at most
        # Where the last draft was copied from, and how long the text was then: the copy's
        # next token stands at _source + (the text's growth since) while the text still
        # follows it.
        self._source = self._source_end = -1

    def draft(self, output: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` tokens that may follow the prompt and
        ``output`` (the sequence's output so far; empty: no draft this step)."""
        tokens = self._tokens
        tokens += output[len(tokens) - self._num_prompt:]
        cfg, end = self.config, len(tokens)
        self._grow(end)
        if self._pause:
            self._pause -= 1
            return []
        k = min(limit, self._length)
        if k <= 0:
            return []
        at = self._continued(end)
        for n in range(min(cfg.prompt_lookup_max, end - 1), cfg.prompt_lookup_min - 1, -1):
            if at is not None:
                break
            at = self._index.get(tuple(tokens[end - n:end]))
        if at is None:
            return []
        self._source, self._source_end = at, end
        return tokens[at:at + k]

    def _continued(self, end: int) -> int | None:
        """Where the stretch the last draft copied goes on, while the text's last
        ``prompt_lookup_max`` tokens are still the ones before it there; else None. Text
        that repeats itself (code's alike lines, a list's items) has several earlier
        occurrences of a short n-gram, and the latest of them is often another line than
        the one being copied. (Letting one token of them differ, a renamed word, measured
        no better on the copy benchmark.)"""
        if self._source < 0:
            return None
        at = self._source + end - self._source_end
        n = min(self.config.prompt_lookup_max, at)
        tokens = self._tokens
        if at >= end or n < self.config.prompt_lookup_min or \
                tokens[at - n:at] != tokens[end - n:end]:
            return None
        return at

    def accepted(self, num_draft: int, num_accepted: int) -> None:
        """What the model made of the last draft: ``num_accepted`` of its ``num_draft``."""
        if num_draft and num_accepted == num_draft:
            self._length = min(self.config.num_speculative_tokens, 2 * num_draft)
        elif num_draft:
            self._length = num_accepted + 1
        if num_accepted:
            self._failures = 0
        elif num_draft:
            self._failures += 1
            self._pause = min(MAX_PAUSE, 1 << (self._failures - 1)) if self._failures > 1 else 0

    def close(self) -> None:
        """The sequence ended (nothing to give back)."""

    def _grow(self, end: int) -> None:
        """Index the n-grams that end before ``end`` and after what is indexed (each has a
        token after it; the sequence's own last n-gram has none): a later occurrence
        replaces an earlier one."""
        tokens, lo, hi = self._tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max
        index = self._index
        for stop in range(max(self._indexed, lo), end):
            for n in range(lo, min(hi, stop) + 1):
                index[tuple(tokens[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)
