"""A backend driven by hand, one step at a time, as the engine would: feed a slot's tokens
from a position, sample, feed the sample back."""

from __future__ import annotations

from typing import Any

from laya_core.backend import StepItem
from laya_core.types import Sample


def generate(backend: Any, slot: int, fed: list[int], start: int, n: int = 8) -> list[Sample]:
    """``n`` samples of ``slot``: ``fed`` at positions ``start``.., then each sample in turn."""
    out: list[Sample] = []
    for _ in range(n):
        sample = backend.step([StepItem(slot, fed, start, True)])[0].sample
        assert sample is not None
        out.append(sample)
        start, fed = start + len(fed), [sample.token_id]
    return out
