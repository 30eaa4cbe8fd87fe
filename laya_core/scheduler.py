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

from laya_core.backend import StepItem
from laya_core.cache import CachePolicy
from laya_core.memory_plan import MAX_SCORED_TOKENS_PER_STEP
from laya_core.prefix_cache import (
    MIN_REUSE_TOKENS,
    PrefixCache,
    best_match,
    common_prefix_len,
)
from laya_core.sequence import Sequence, SequenceStatus


@attrs.frozen
class SchedulerConfig:
    max_num_seqs: int = attrs.field(validator=attrs.validators.ge(1))
    # Tokens one engine step may feed the model: one per decoding sequence, the rest prefill.
    max_step_tokens: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    # Keep finished sequences' KV for later prompts that start the same way.
    prefix_caching: bool = False
    # Move a running sequence into a hole in the block of running slots when nothing waits to
    # fill it (for backends with ``supports_moving``).
    compaction: bool = False
    # Prompt positions one step may score (prompt log-probabilities): each needs a row of
    # logits, counted in the memory plan (memory_plan.scored_tokens_per_step).
    max_scored_tokens: int = attrs.field(default=MAX_SCORED_TOKENS_PER_STEP,
                                         validator=attrs.validators.ge(1))


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

    def item(self) -> StepItem:
        """What the backend is asked: the tokens to feed, the prompt tokens to score, and
        the tokens the sampled one may be."""
        seq = self.seq
        assert seq.slot is not None
        samples = self.samples
        return StepItem(seq.slot, self.tokens, self.start_pos, samples,
                        seq.score_targets(self.start_pos, len(self.tokens)),
                        seq.params.prompt_logprobs or 0,
                        seq.allowed_tokens() if samples else None)


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
        self._moved: list[tuple[int, int, int]] = []  # retained KV to move: (from, to, tokens)
        # Slots (retained or running) that sequences admitted in this step copy their prefix
        # from: the copy happens when the engine starts them, so until then these can be
        # neither evicted nor moved. Cleared by take_moved(), called after scheduling.
        self._pinned: set[int] = set()
        self._compactions: list[tuple[int, int, int]] = []  # running sequences moved

    @property
    def num_retained_blocks(self) -> int:
        """Blocks holding finished sequences' KV, given back whenever room is needed."""
        return sum(self._retained_blocks.values())

    def take_evicted(self) -> list[int]:
        """Slots evicted since the last call; the engine drops their KV before the next step."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_moved(self) -> list[tuple[int, int, int]]:
        """Retained KV moved since the last call, as (from slot, to slot, tokens), in order.

        The engine moves it after dropping the evicted slots and before starting new
        sequences (which may take a slot that was moved from). The engine calls this after
        each ``schedule()`` that returned work, before it starts the new sequences.
        """
        moved, self._moved = self._moved, []
        self._pinned.clear()
        return moved

    def take_compactions(self) -> list[tuple[int, int, int]]:
        """Running sequences moved since the last call, as (from slot, to slot, tokens of KV).

        The engine moves them after the retained KV of ``take_moved()``.
        """
        compactions, self._compactions = self._compactions, []
        return compactions

    def _compact(self) -> None:
        """Close the lowest hole in the block of running slots with the highest running one.

        Only when nothing waits (an admission fills holes for free), at most once a step (a
        move copies the sequence's KV), and never for a sequence still prefilling or lending
        its KV in this step. Retained KV in the hole moves away first, as in ``_pick_slot``.
        """
        if not self.config.compaction or self.waiting or len(self.running) < 2:
            return
        running = {s.slot for s in self.running if s.slot is not None}
        low, high = min(running), max(running)
        if high - low + 1 == len(running):
            return
        seq = next(s for s in self.running if s.slot == high)
        hole = next(h for h in range(low, high) if h not in running)
        if seq.is_prefilling or high in self._pinned or hole in self._pinned:
            return
        if hole in self.prefix:
            to = self._move_target(exclude={hole}, wanted=set(), running=running)
            if to is None:
                return
            self._move(hole, to)
        else:
            self._free_slots.remove(hole)
        self._free_slots.append(high)
        self._compactions.append((high, hole, seq.num_computed))
        seq.slot = hole

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
                kept = self._retain(seq.slot, seq.computed_token_ids, seq.num_prompt_tokens)
            if not kept:
                self._free_slots.append(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        return kept

    def _retain(self, slot: int, tokens: list[int], num_prompt_tokens: int) -> bool:
        """Keep a finished sequence's KV unless another retained slot already holds it.

        A retained slot that holds a prefix of ``tokens``, or the same prompt with another
        answer, is dropped instead: a question asked again would otherwise fill every slot
        with copies of itself.
        """
        for other, held in list(self.prefix.entries()):
            shared = common_prefix_len(tokens, held)
            if shared == len(tokens):  # already cached, in full
                self.prefix.touch(other)
                return False
            if shared == len(held) or shared >= num_prompt_tokens:
                self._evict(other)
        self.cache.allocate(_retained_key(slot), len(tokens))  # fits: just freed
        self._retained_blocks[slot] = self.cache.blocks_for(len(tokens))
        self.prefix.retain(slot, tokens)
        return True

    def can_admit(self, seq: Sequence) -> bool:
        """Whether the sequence fits now, counting retained KV as room (it can be evicted)."""
        evictable = [slot for slot in self.prefix.slots() if slot not in self._pinned]
        slots = len(self._free_slots) + len(evictable)
        blocks = self.cache.num_free_blocks + sum(self._retained_blocks[s] for s in evictable)
        return slots > 0 and self.cache.blocks_for(seq.max_total_tokens) <= blocks

    def admit(self, seq: Sequence) -> None:
        """Give the sequence a slot and its worst case of cache, reusing a known prefix."""
        match = self._best_prefix(seq) if self.config.prefix_caching else None
        while not self.cache.can_allocate(seq.max_total_tokens):
            victim = next((s for s in self.prefix.slots() if s not in self._pinned), None)
            assert victim is not None, "admit() without can_admit()"
            if match is not None and victim == match[0]:
                match = None  # the prefix's source itself has to make room
            self._evict(victim)
        source = match[0] if match is not None and match[0] in self.prefix else None
        seq.slot = self._pick_slot(source, lossless=source is not None and match is not None
                                   and match[1] >= self.prefix.num_tokens(source))
        if seq.slot == source:  # taken over: its KV is the prefix
            self._drop_retained(source)
        elif source is not None:
            self.prefix.touch(source)  # copied from: it stays cached, as just used
            self._pinned.add(source)
        elif match is not None:
            self._pinned.add(match[0])  # a running sequence lends its KV: it must stay put
        if match is not None:
            seq.reuse = match
            seq.num_computed = match[1]
        self.cache.allocate(seq.seq_id, seq.max_total_tokens)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_time = time.perf_counter()
        self.running.append(seq)

    def _pick_slot(self, source: int | None, lossless: bool) -> int:
        """A free or retained slot for a new sequence, next to running ones where possible.

        Backends that batch neighbouring slots together (llama.cpp with a KV stream per slot
        runs each run of consecutive slots as its own forward pass) decode fastest when the
        running slots form one block. So the choice goes to the slot with the most running
        neighbours first. Then: ``source`` (the retained slot holding this prompt's prefix)
        when taking it over loses nothing, a free slot, ``source`` when its KV holds more than
        the prefix (the rest is lost), and last any other retained slot, least recently used
        first; the lowest number breaks ties. A retained slot that is taken loses its KV,
        unless a waiting sequence would reuse it: then the KV moves to a slot away from the
        block (a free one, else the least recently used one nobody waits for), or, with no
        such slot, the slot is taken only when nothing else is left.
        """
        running = {s.slot for s in self.running if s.slot is not None}
        age = {slot: i for i, slot in enumerate(self.prefix.slots())}
        wanted = self._wanted_by_waiting() if age and self.waiting else set()

        def preference(slot: int) -> tuple[bool, int, int, int, int]:
            neighbours = (slot - 1 in running) + (slot + 1 in running)
            if slot == source:
                rank = 3 if lossless else 1
            else:
                rank = 0 if slot in age else 2
            return slot not in kept, neighbours, rank, -age.get(slot, 0), -slot

        kept: set[int] = set()
        # Pinned slots are copied from in this step; the one this sequence copies from can
        # still be taken over (the copies run first, in admission order).
        candidates = [*self._free_slots, *(s for s in age if s not in self._pinned or s == source)]
        slot = max(candidates, key=preference)
        if slot in wanted and slot != source:
            to = self._move_target(exclude={slot, source}, wanted=wanted, running=running)
            if to is None:  # nowhere to move it: keep it, if anything else is left
                kept = wanted - {source}
                slot = max(candidates, key=preference)
            else:
                self._move(slot, to)
                return slot
        if slot != source:
            if slot in age:
                self._evict(slot)
            self._free_slots.remove(slot)
        return slot

    def _move_target(self, exclude: set[int | None], wanted: set[int],
                     running: set[int]) -> int | None:
        """Where to move retained KV out of the way: a free slot with the fewest running
        neighbours (the highest number on a tie), else the least recently used retained slot
        that no waiting sequence wants (evicted)."""
        free = [s for s in self._free_slots if s not in exclude]
        if free:
            return min(free, key=lambda s: ((s - 1 in running) + (s + 1 in running), -s))
        for slot in self.prefix.slots():
            if slot not in exclude and slot not in wanted and slot not in self._pinned:
                self._evict(slot)
                return slot
        return None

    def _move(self, slot: int, to: int) -> None:
        """Move a retained slot's KV to the free slot ``to``; ``slot`` is then in use."""
        tokens = self.prefix.take(slot)
        blocks = self._retained_blocks.pop(slot)
        self.cache.free(_retained_key(slot))
        self._free_slots.remove(to)
        self.cache.allocate(_retained_key(to), len(tokens))  # fits: just freed
        self._retained_blocks[to] = blocks
        self.prefix.retain(to, tokens)
        self._moved.append((slot, to, len(tokens)))

    def _wanted_by_waiting(self) -> set[int]:
        """Retained slots whose KV a waiting sequence would reuse: evicted last.

        Only the sequences next in line count (as many as can run at once): a long queue
        must not make every admission slow.
        """
        wanted = set()
        for seq in itertools.islice(self.waiting, self.config.max_num_seqs):
            if seq.num_prompt_tokens > MIN_REUSE_TOKENS and not seq.scores_prompt:
                match = best_match(seq.prompt_token_ids, self.prefix.entries())
                if match is not None:
                    wanted.add(match[0])
        return wanted

    def _evict(self, slot: int) -> None:
        """Drop a retained slot's KV (the engine tells the backend) and free the slot."""
        self._drop_retained(slot)
        self._free_slots.append(slot)
        self._evicted.append(slot)

    def _drop_retained(self, slot: int) -> None:
        self.prefix.take(slot)
        self.cache.free(_retained_key(slot))
        del self._retained_blocks[slot]

    def _best_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        if seq.num_prompt_tokens <= MIN_REUSE_TOKENS or seq.scores_prompt:
            return None  # too short to reuse anything, or it needs every position's logits
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
    behind it, so a long request cannot be starved by a stream of short ones. Prompts whose
    log-probabilities are wanted share a smaller budget too: ``max_scored_tokens`` a step.
    """

    def schedule(self) -> list[Chunk]:
        while self.waiting and self.can_admit(self.waiting[0]):
            self.admit(self.waiting.popleft())
        self._compact()
        budget, scored = self.config.max_step_tokens, self.config.max_scored_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            scoring = seq.scores_prompt and seq.is_prefilling
            tokens = seq.tokens_to_compute(min(budget, scored) if scoring else budget)
            if tokens:  # empty: a prompt that waits rather than leave a lone last token
                chunks.append(Chunk(seq, tokens, seq.num_computed))
                budget -= len(tokens)
                scored -= len(tokens) if scoring else 0
        return chunks
