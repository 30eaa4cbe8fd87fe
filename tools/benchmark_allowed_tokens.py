"""Time what an allowed-token mask costs a sampled row, per step and per sequence.

    python tools/benchmark_allowed_tokens.py --vocab 49152

For masks allowing few (12), half (random) and most (all but 152) tokens of a vocabulary
the size of SmolLM2's, times the pieces a backend runs for one constrained row: wrapping a
grammar engine's bitmask, the emptiness check, masking a float32 logits row in place, and
the bool unpack a torch backend would use; and, to compare, building a frozenset of the
allowed ids. Prints the median of many runs in microseconds, one line each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from laya_core.engine.allowed_tokens import AllowedTokens


def median_us(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def time_mask(ids: np.ndarray, vocab: int, row: np.ndarray, runs: int) -> dict[str, float]:
    """Median microseconds of each piece, for the mask allowing ``ids``."""
    mask = AllowedTokens.of(ids.tolist(), vocab)
    words = mask.words.view(np.int32)  # as llguidance fills it
    logits = row.copy()
    return {
        "from_bitmask": median_us(lambda: AllowedTokens.from_bitmask(words, vocab), runs),
        "is_empty": median_us(mask.is_empty, runs),
        "mask_logits": median_us(lambda: mask.mask_logits(logits), runs),
        "to_bools": median_us(mask.to_bools, runs),
        "frozenset": median_us(lambda: frozenset(ids.tolist()), max(runs // 20, 5)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    vocab, rng = args.vocab, np.random.default_rng(0)
    row = rng.standard_normal(vocab).astype(np.float32)
    for label, count in (("few", 12), ("half", vocab // 2), ("most", vocab - 152)):
        ids = np.sort(rng.choice(vocab, count, replace=False))
        timings = time_mask(ids, vocab, row, args.runs)
        print(f"{label:>4} ({count:>6} of {vocab}): "
              + ", ".join(f"{name} {us:.1f} us" for name, us in timings.items()))

if __name__ == "__main__":
    main()
