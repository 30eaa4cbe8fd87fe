"""The tokens a sequence may sample next: a bitmask over the vocabulary.

A constraint (structured output's grammar matcher) decides, before each token a sequence
samples, which tokens may come next. The engine puts that set into the step's
:class:`~laya_core.backend.StepItem`; every backend masks the rest out before its sampler
runs, greedy or random, and reports log-probabilities of the model's unmasked distribution.

The set is a packed bitmask, the layout grammar engines fill in place (llguidance's
``fill_next_token_bitmask``, xgrammar's token bitmask): bit ``t % 32`` of 32-bit word
``t // 32`` is set where token ``t`` is allowed. For a 49,152-token vocabulary that is 6 KiB
per step, the same whether few tokens or most are allowed, where a set of ids would grow to
49,152 Python ints (a frozenset of them took 1.2 ms to build). Measured on AMD EPYC (numpy,
one core) for that vocabulary: :meth:`AllowedTokens.mask_logits` 23-26 us a row whether 12,
24,576 or 49,000 tokens are allowed; :meth:`AllowedTokens.is_empty` 1.3 us.

End-of-generation tokens are tokens like any other here: a mask without them means the
sequence cannot stop at this step (only a stop string, ``max_tokens`` or the context length
ends it), so a constraint allows them where its output may end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

# The bits of float32 -inf, OR-ed into the logits of masked tokens.
_NEG_INF_BITS = np.uint32(0xFF800000)


def num_words(vocab_size: int) -> int:
    """The 32-bit words a mask over ``vocab_size`` tokens holds."""
    return (vocab_size + 31) // 32


def _check_words(instance: AllowedTokens, attribute: attrs.Attribute[np.ndarray],
                 words: np.ndarray) -> None:
    if words.dtype != np.uint32 or words.shape != (num_words(instance.vocab_size),):
        raise ValueError(f"an allowed-token mask over {instance.vocab_size} tokens is "
                         f"{num_words(instance.vocab_size)} uint32 words, not "
                         f"{words.shape} of {words.dtype}")


@attrs.frozen(eq=False)
class AllowedTokens:
    """The tokens allowed next, as a bitmask; see the module docstring for the layout.

    ``words`` is not copied: a grammar engine may fill a fresh array each step and hand it
    over. It must not change afterwards (the backend reads it during the step). Bits past
    ``vocab_size`` in the last word are ignored.
    """

    vocab_size: int = attrs.field(validator=attrs.validators.gt(0))
    words: np.ndarray = attrs.field(validator=_check_words)  # [num_words(vocab_size)] uint32

    @classmethod
    def of(cls, token_ids: Iterable[int], vocab_size: int) -> AllowedTokens:
        """The mask allowing exactly ``token_ids`` (each in ``0 .. vocab_size-1``)."""
        ids = np.fromiter(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"allowed token ids must lie in 0 .. {vocab_size - 1}")
        bools = np.zeros(num_words(vocab_size) * 32, dtype=bool)
        bools[ids] = True
        return cls(vocab_size, np.packbits(bools, bitorder="little").view(np.uint32))

    @classmethod
    def from_bitmask(cls, words: np.ndarray, vocab_size: int) -> AllowedTokens:
        """Wrap a grammar engine's bitmask (int32 or uint32 words) without copying it."""
        words = np.asarray(words)
        if words.dtype == np.int32:
            words = words.view(np.uint32)
        return cls(vocab_size, words)

    def allows(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool((int(self.words[token_id >> 5]) >> (token_id & 31)) & 1)

    def is_empty(self) -> bool:
        """Whether no token of the vocabulary is allowed (the constraint cannot go on)."""
        full, rest = divmod(self.vocab_size, 32)
        if self.words[:full].any():
            return False
        return not rest or not int(self.words[full]) & ((1 << rest) - 1)

    def to_bools(self) -> np.ndarray:
        """[vocab_size] bool: True where the token is allowed."""
        bits = np.unpackbits(self.words.view(np.uint8), count=self.vocab_size,
                             bitorder="little")
        return bits.view(bool)

    def token_ids(self) -> np.ndarray:
        """The allowed token ids, ascending."""
        return np.flatnonzero(self.to_bools())

    def mask_logits(self, logits: np.ndarray) -> None:
        """Set the logits of disallowed tokens to -inf, in place.

        ``logits``: [vocab_size] float32 (a backend's own output row). A bitwise select
        rather than ``np.copyto(where=)``: the same 23-26 us a row for any mask, where the
        branchy copy took 10 us for a mask allowing almost all and 88 us for one allowing
        a random half (AMD EPYC, 49,152 tokens).
        """
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"a mask over {self.vocab_size} tokens cannot mask logits of "
                             f"shape {logits.shape}")
        if logits.dtype != np.float32 or not logits.flags.c_contiguous:
            np.copyto(logits, -np.inf, where=~self.to_bools())
            return
        bits = logits.view(np.uint32)
        keep = self.to_bools().view(np.uint8).astype(np.uint32)
        np.negative(keep, out=keep)  # allowed: all ones, masked: zero
        np.bitwise_and(bits, keep, out=bits)
        np.invert(keep, out=keep)
        np.bitwise_and(keep, _NEG_INF_BITS, out=keep)
        np.bitwise_or(bits, keep, out=bits)


# What structured output attaches to a sequence (``Request.constraint``): given the tokens
# generated so far, the tokens allowed next, or None for any. Called on the engine thread
# once before each token the sequence samples.
TokenConstraint = Callable[[Sequence[int]], AllowedTokens | None]


def looks_ahead(constraint: TokenConstraint) -> bool:
    """Whether ``constraint`` gives the masks of a drafted step's rows (speculative
    decoding): it has a method ``along(generated, draft)`` returning the mask for the token
    after ``generated``, then after each draft token for as long as each is allowed where it
    stands, without moving its own state (structured output's matchers do). A plain callable
    sees only the tokens a sequence keeps, so its sequence decodes without drafts."""
    return callable(getattr(constraint, "along", None))

NO_TOKEN_ALLOWED = ("the output constraint allows no next token: it cannot be continued "
                    "from the tokens generated so far")
