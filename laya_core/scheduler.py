"""Scheduling: which sequences prefill or decode in the next engine step.

The scheduler owns the waiting queue, the running set and the backend slots (sequence ids
``0 .. max_num_seqs-1`` in the backend's KV cache). It imports no model library.
"""

from __future__ import annotations

import abc
import collections
import time

import attrs

from laya_core.cache import CachePolicy
from laya_core.sequence import Sequence, SequenceStatus


@attrs.frozen
class SchedulerConfig:
    max_num_seqs: int = attrs.field(validator=attrs.validators.ge(1))
    # Tokens one engine step may feed the model: one per decoding sequence, the rest prefill.
    max_step_tokens: int = attrs.field(default=512, validator=attrs.validators.ge(1))


@attrs.frozen
class Chunk:
    """Part of one sequence's work in a step: feed ``tokens`` starting at ``start_pos``."""

    seq: Sequence
    tokens: list[int]
    start_pos: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a new token is sampled."""
        return self.start_pos + len(self.tokens) == self.seq.num_tokens


class Scheduler(abc.ABC):
    """Chooses the work of each engine step within the cache budget."""

    def __init__(self, config: SchedulerConfig, cache: CachePolicy) -> None:
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if not self.cache.can_ever_hold(seq.max_total_tokens):
            raise ValueError(
                f"sequence {seq.seq_id} needs {seq.max_total_tokens} tokens of KV cache; "
                f"the pool holds {self.cache.capacity_tokens}"
            )
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence, waiting or running, and give back its cache and slot."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
            assert seq.slot is not None
            self._free_slots.append(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def can_admit(self, seq: Sequence) -> bool:
        return bool(self._free_slots) and self.cache.can_allocate(seq.max_total_tokens)

    def admit(self, seq: Sequence) -> None:
        self.cache.allocate(seq.seq_id, seq.max_total_tokens)
        seq.slot = self._free_slots.pop()
        seq.status = SequenceStatus.RUNNING
        seq.admitted_time = time.perf_counter()
        self.running.append(seq)

    @abc.abstractmethod
    def schedule(self) -> list[Chunk]:
        """Admit what fits and return this step's chunks (empty when there is nothing to do)."""


class FcfsScheduler(Scheduler):
    """First come, first served, with decode before prefill and chunked prefill.

    Decoding sequences go first, one token each, so running streams keep flowing; the rest of
    the step's token budget prefills prompts in arrival order, in chunks. A waiting sequence is
    admitted only when its worst case fits in the cache; a head that does not fit blocks those
    behind it, so a long request cannot be starved by a stream of short ones.
    """

    def schedule(self) -> list[Chunk]:
        while self.waiting and self.can_admit(self.waiting[0]):
            self.admit(self.waiting.popleft())
        budget = self.config.max_step_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            tokens = seq.tokens_to_compute(budget)
            chunks.append(Chunk(seq, tokens, seq.num_computed))
            budget -= len(tokens)
        return chunks
