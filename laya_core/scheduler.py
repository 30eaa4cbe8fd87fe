"""Scheduling: which sequences prefill or decode in the next engine step.

The scheduler owns the waiting queue, the running set and the backend slots (sequence ids
``0 .. max_num_seqs-1`` in the backend's KV cache). It imports no model library.
"""

from __future__ import annotations

import abc
import collections
import itertools
import time

import attrs

from laya_core.cache import CachePolicy
from laya_core.prefix_cache import MIN_REUSE_TOKENS, PrefixCache, best_match
from laya_core.sequence import Sequence, SequenceStatus


@attrs.frozen
class SchedulerConfig:
    max_num_seqs: int = attrs.field(validator=attrs.validators.ge(1))
    # Tokens one engine step may feed the model: one per decoding sequence, the rest prefill.
    max_step_tokens: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    # Keep finished sequences' KV for later prompts that start the same way.
    prefix_caching: bool = False


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
        self.prefix = PrefixCache()
        self._retained_blocks: dict[int, int] = {}  # slot -> blocks its retained KV holds
        self._evicted: list[int] = []  # retained slots whose KV the backend must drop

    @property
    def num_retained_blocks(self) -> int:
        """Blocks holding finished sequences' KV, given back whenever room is needed."""
        return sum(self._retained_blocks.values())

    def take_evicted(self) -> list[int]:
        """Slots evicted since the last call; the engine drops their KV before the next step."""
        evicted, self._evicted = self._evicted, []
        return evicted

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

    def finish(self, seq: Sequence, retain: bool = False) -> bool:
        """Remove a sequence, waiting or running, and give back its cache and slot.

        With ``retain`` (and prefix caching on) a running sequence's computed KV stays in its
        slot for later prompts; returns whether it did.
        """
        kept = False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
            assert seq.slot is not None
            kept = retain and self.config.prefix_caching and seq.num_computed > 0
            if kept:
                tokens = seq.computed_token_ids
                self.cache.allocate(_retained_key(seq.slot), len(tokens))  # fits: just freed
                self._retained_blocks[seq.slot] = self.cache.blocks_for(len(tokens))
                self.prefix.retain(seq.slot, tokens)
            else:
                self._free_slots.append(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        return kept

    def can_admit(self, seq: Sequence) -> bool:
        """Whether the sequence fits now, counting retained KV as room (it can be evicted)."""
        slots = len(self._free_slots) + len(self.prefix)
        blocks = self.cache.num_free_blocks + self.num_retained_blocks
        return slots > 0 and self.cache.blocks_for(seq.max_total_tokens) <= blocks

    def admit(self, seq: Sequence) -> None:
        """Give the sequence a slot and its worst case of cache, reusing a known prefix."""
        match = self._best_prefix(seq) if self.config.prefix_caching else None
        if match is not None and match[0] in self.prefix:
            seq.slot = match[0]  # take over the retained slot: its KV is the prefix
            self._drop_retained(seq.slot)
        while not (seq.slot is not None or self._free_slots) or \
                not self.cache.can_allocate(seq.max_total_tokens):
            victim = self.prefix.oldest()
            assert victim is not None, "admit() without can_admit()"
            self._drop_retained(victim)
            self._free_slots.append(victim)
            self._evicted.append(victim)
        if seq.slot is None:
            seq.slot = self._free_slots.pop()
        if match is not None:
            seq.reuse = match
            seq.num_computed = match[1]
        self.cache.allocate(seq.seq_id, seq.max_total_tokens)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_time = time.perf_counter()
        self.running.append(seq)

    def _drop_retained(self, slot: int) -> None:
        self.prefix.take(slot)
        self.cache.free(_retained_key(slot))
        del self._retained_blocks[slot]

    def _best_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        if seq.num_prompt_tokens <= MIN_REUSE_TOKENS:
            return None  # too short to reuse anything: skip building the candidates
        live = ((s.slot, s.computed_token_ids)
                for s in self.running if s.num_computed and s.slot is not None)
        return best_match(seq.prompt_token_ids, itertools.chain(self.prefix.entries(), live))

    @abc.abstractmethod
    def schedule(self) -> list[Chunk]:
        """Admit what fits and return this step's chunks (empty when there is nothing to do)."""


def _retained_key(slot: int) -> int:
    """Cache-policy key of a retained slot's KV: negative, so never a sequence id."""
    return -1 - slot


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
