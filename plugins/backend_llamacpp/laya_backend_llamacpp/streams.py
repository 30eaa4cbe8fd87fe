"""The llama.cpp cache policy: a KV stream per slot, retained slots, moves and compaction.

llama.cpp keeps a sequence's KV in a *stream* named by a sequence id, its *slot*; a slot's
stream holds one sequence at a time. This policy hands out slots, keeps a finished
sequence's stream for later prompts that start the same way (prefix reuse), and records
what the backend must do as ops, in the order they happened: the engine applies them before
the step's ``llama_decode``, so a copy always reads the KV it was planned from.

- **Accounting.** The pool is counted in blocks of 16 tokens; a running sequence reserves
  its worst case (prompt + max_tokens) at admission, so it never needs preempting. Retained
  KV is counted apart and given back, least recently used first, when room is needed.
- **Placement.** llama.cpp with a stream per slot runs each run of consecutive slots as its
  own forward pass (8 sequences decoded in 35 ms as one block, 61 ms scattered over four),
  so a new sequence takes the slot with the most running neighbours, and when sequences
  finish and nothing waits to fill the hole, the highest running sequence moves into it.
- **Reuse.** At admission the longest prefix of the new prompt held by a retained or
  running sequence is found. A retained slot whose KV is all prefix is taken over;
  otherwise the prefix is copied and the cached text stays for the prompt it answered.
  KV that a waiting request will reuse is moved out of the way rather than dropped.
- **Adapters.** KV computed under a LoRA adapter is another text's KV: a retained, running
  or saved stream is reused only by a sequence of the same adapter (or of none).
- **Saved KV.** A slot holds one sequence, so slots alone keep ``max_num_seqs``
  conversations at most. An evicted stream's KV is first saved to host memory, up to the
  backend's ``saved_kv_tokens`` (planned), least recently saved forgotten first; a prompt
  whose longest known beginning is saved gets it back into its new slot.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from laya_backend_llamacpp.stream_ops import (
    DropStream,
    ForgetSaved,
    MoveStream,
    SaveStream,
    StartStream,
)
from laya_core.engine.request import Request
from laya_core.kv.hashing import BLOCK_SIZE
from laya_core.kv.policies import KVCache, KVOp, max_reuse_tokens
from laya_core.kv.prefix import MIN_REUSE_TOKENS, best_match, common_prefix_len


class RetainedSlots:
    """Slots holding finished sequences' KV, with its tokens and the LoRA adapter it was
    computed under, least recently used first."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._adapters: dict[int, str | None] = {}

    def __contains__(self, slot: int) -> bool:
        return slot in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def retain(self, slot: int, tokens: list[int], adapter: str | None = None) -> None:
        self._entries[slot] = tokens
        self._adapters[slot] = adapter

    def take(self, slot: int) -> list[int]:
        self._adapters.pop(slot, None)
        return self._entries.pop(slot)

    def adapter(self, slot: int) -> str | None:
        return self._adapters.get(slot)

    def num_tokens(self, slot: int) -> int:
        return len(self._entries[slot])

    def touch(self, slot: int) -> None:
        """Mark a retained slot as just used, so it is evicted last."""
        self._entries.move_to_end(slot)

    def slots(self) -> list[int]:
        return list(self._entries)

    def entries(self, adapter: str | None = None) -> Iterable[tuple[int, list[int]]]:
        """(slot, tokens) of the KV computed under ``adapter`` (None: the base model)."""
        return ((slot, tokens) for slot, tokens in self._entries.items()
                if self._adapters.get(slot) == adapter)


class StreamsKVCache(KVCache):
    """Slots of llama.cpp KV streams for running and retained sequences (module docstring)."""

    layout = "streams"

    def __init__(self, num_tokens: int, max_num_seqs: int, prefix_caching: bool = True,
                 block_size: int = BLOCK_SIZE) -> None:
        super().__init__(num_tokens, max_num_seqs, prefix_caching, block_size)
        self.num_slots = max_num_seqs
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.prefix = RetainedSlots()
        self._retained_blocks: dict[int, int] = {}  # slot -> blocks its retained KV holds
        self._slot: dict[int, int] = {}  # running sequence id -> its slot
        self._blocks: dict[int, int] = {}  # running sequence id -> blocks reserved
        self._waiting: Sequence[Request] = ()
        self._running: Sequence[Request] = ()
        # Close holes in the block of running slots (backends with supports_moving).
        self.compaction = False
        # Evicted streams' KV kept in host memory (backends with saved_kv_tokens), by key,
        # least recently saved first; at most saved_capacity tokens in all.
        self.saved: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._saved_adapter: dict[int, str | None] = {}  # key -> the adapter of its KV
        self.saved_capacity = 0
        self.num_saved_tokens = 0
        self._keys = itertools.count()

    def allocate(self, backend: Any) -> None:
        super().allocate(backend)
        self.compaction = bool(getattr(backend, "supports_moving", False))
        self.saved_capacity = int(getattr(backend, "saved_kv_tokens", 0))

    def bind(self, waiting: Sequence[Request], running: Sequence[Request]) -> None:
        self._waiting, self._running = waiting, running

    # -- counts -------------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return sum(self._blocks.values())

    @property
    def num_cached_blocks(self) -> int:
        return sum(self._retained_blocks.values())

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks - self.num_cached_blocks

    def handle(self, seq: Request) -> int:
        return self._slot[seq.seq_id]

    def slot_of(self, seq: Request) -> int | None:
        """The slot ``seq`` runs in, or None."""
        return self._slot.get(seq.seq_id)

    # -- admission and finishing ----------------------------------------------------------

    def can_admit(self, seq: Request) -> bool:
        """Whether the sequence fits now, counting retained KV as room (it can be evicted)."""
        slots = len(self._free_slots) + len(self.prefix)
        blocks = self.num_free_blocks + self.num_cached_blocks
        return slots > 0 and self.blocks_for(seq.max_total_tokens) <= blocks

    def admit(self, seq: Request) -> None:
        """Give the sequence a slot and its worst case of cache, reusing a known prefix."""
        match, saved = self._best_prefix(seq)
        restore = None
        if saved is not None and (match is None or saved[1] > match[1]):
            match, restore = None, saved
            self._take_saved(saved[0])  # before evictions below could forget it
        need = self.blocks_for(seq.max_total_tokens)
        while need > self.num_free_blocks:
            victim = self.prefix.slots()[0]
            if match is not None and victim == match[0]:
                match = None  # the prefix's source itself has to make room
            self._evict(victim)
        source = match[0] if match is not None and match[0] in self.prefix else None
        slot = self._pick_slot(source, lossless=source is not None and match is not None
                               and match[1] >= self.prefix.num_tokens(source))
        n = match[1] if match is not None else restore[1] if restore is not None else 0
        if restore is not None:
            self._ops.append(StartStream(slot, seq.params, num_copied=n, restore=restore[0]))
        elif slot == source:  # taken over: its KV is the prefix
            adapter = self.prefix.adapter(source)
            held = self._drop_retained(source)
            if n < len(held):  # the rest would be lost: save it first
                self._save(source, held, adapter)
            self._ops.append(StartStream(slot, seq.params, keep_tokens=n))
        else:
            if source is not None:
                self.prefix.touch(source)  # copied from: it stays cached, as just used
            copy_from = match[0] if match is not None else None
            self._ops.append(StartStream(slot, seq.params, copy_from=copy_from, num_copied=n))
        seq.num_computed = seq.num_cached_tokens = n
        self._slot[seq.seq_id] = slot
        self._blocks[seq.seq_id] = need

    def finish(self, seq: Request, retain: bool) -> None:
        """A running sequence left: with ``retain`` (and prefix caching on) its computed KV
        stays in its slot for later prompts, else the backend drops its stream."""
        slot = self._slot.pop(seq.seq_id)
        del self._blocks[seq.seq_id]
        kept = retain and self.prefix_caching and seq.num_computed > 0 \
            and self._retain(slot, seq.computed_token_ids, seq.num_prompt_tokens,
                             seq.params.lora)
        if not kept:
            self._free_slots.append(slot)
            self._ops.append(DropStream(slot))

    def _retain(self, slot: int, tokens: list[int], num_prompt_tokens: int,
                adapter: str | None) -> bool:
        """Keep a finished sequence's KV (computed under ``adapter``) unless another retained
        slot already holds it.

        A retained slot of the same adapter that holds a prefix of ``tokens``, or the same
        prompt with another answer, is dropped instead: a question asked again would
        otherwise fill every slot with copies of itself.
        """
        for other, held in list(self.prefix.entries(adapter)):
            shared = common_prefix_len(tokens, held)
            if shared == len(tokens):  # already cached, in full
                self.prefix.touch(other)
                return False
            if shared == len(held) or shared >= num_prompt_tokens:
                self._evict(other, save=False)
        self._retained_blocks[slot] = self.blocks_for(len(tokens))  # fits: just freed
        self.prefix.retain(slot, tokens, adapter)
        return True

    def before_step(self) -> None:
        self._compact()

    def forget_adapter(self, name: str) -> None:
        """Drop the retained and saved KV computed under adapter ``name``."""
        for slot in [s for s in self.prefix.slots() if self.prefix.adapter(s) == name]:
            self._evict(slot, save=False)
        for key, _ in self._saved_entries(name):
            self._forget(key)

    def op_failed(self, op: KVOp) -> tuple[int, ...]:
        """The backend could not apply ``op``: a stream it was to start or move fails its
        sequence; saved KV it was to make, or retained KV it was to move, is forgotten (the
        slot is free again, and a start clears a stream). A failed drop or forget leaves
        KV the next start in that slot clears, or bytes nobody asks for."""
        if isinstance(op, StartStream):
            return (op.slot,)
        if isinstance(op, MoveStream):
            if op.running:
                return (op.dst,)
            if op.dst in self.prefix:
                self._drop_retained(op.dst)
                self._free_slots.append(op.dst)
        elif isinstance(op, SaveStream) and op.key in self.saved:
            self._take_saved(op.key)
        return ()

    # -- placement ------------------------------------------------------------------------

    def _running_slots(self) -> set[int]:
        return set(self._slot.values())

    def _pick_slot(self, source: int | None, lossless: bool) -> int:
        """A free or retained slot for a new sequence, next to running ones where possible.

        The choice goes to the slot with the most running neighbours first. Then: ``source``
        (the retained slot holding this prompt's prefix) when taking it over loses nothing,
        a free slot, ``source`` when its KV holds more than the prefix (the rest is lost),
        and last any other retained slot, least recently used first; the lowest number
        breaks ties. A retained slot that is taken loses its KV, unless a waiting sequence
        would reuse it: then the KV moves to a slot away from the block (a free one, else
        the least recently used one nobody waits for), or, with no such slot, the slot is
        taken only when nothing else is left.
        """
        running = self._running_slots()
        age = {slot: i for i, slot in enumerate(self.prefix.slots())}
        wanted = self._wanted_by_waiting() if age and self._waiting else set()

        def preference(slot: int) -> tuple[bool, int, int, int, int]:
            neighbours = (slot - 1 in running) + (slot + 1 in running)
            if slot == source:
                rank = 3 if lossless else 1
            else:
                rank = 0 if slot in age else 2
            return slot not in kept, neighbours, rank, -age.get(slot, 0), -slot

        kept: set[int] = set()
        candidates = [*self._free_slots, *age]
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
            if slot not in exclude and slot not in wanted:
                self._evict(slot)
                return slot
        return None

    def _move(self, slot: int, to: int) -> None:
        """Move a retained slot's KV to the free slot ``to``; ``slot`` is then in use."""
        adapter = self.prefix.adapter(slot)
        tokens = self.prefix.take(slot)
        self._free_slots.remove(to)
        self._retained_blocks[to] = self._retained_blocks.pop(slot)
        self.prefix.retain(to, tokens, adapter)
        self._ops.append(MoveStream(slot, to, len(tokens)))

    def _compact(self) -> None:
        """Close the lowest hole in the block of running slots with the highest running one.

        Only when nothing waits (an admission fills holes for free), at most once a step (a
        move copies the sequence's KV), and never for a sequence still prefilling. Retained
        KV in the hole moves away first, as in ``_pick_slot``.
        """
        if not self.compaction or self._waiting or len(self._slot) < 2:
            return
        running = self._running_slots()
        low, high = min(running), max(running)
        if high - low + 1 == len(running):
            return
        seq = next(s for s in self._running if self._slot[s.seq_id] == high)
        hole = next(h for h in range(low, high) if h not in running)
        if seq.is_prefilling:
            return
        if hole in self.prefix:
            to = self._move_target(exclude={hole}, wanted=set(), running=running)
            if to is None:
                return
            self._move(hole, to)
        else:
            self._free_slots.remove(hole)
        self._free_slots.append(high)
        self._ops.append(MoveStream(high, hole, seq.num_computed, running=True))
        self._slot[seq.seq_id] = hole

    def _wanted_by_waiting(self) -> set[int]:
        """Retained slots whose KV a waiting sequence would reuse: evicted last."""
        return self._wanted(self.prefix.entries)

    def _saved_entries(self, adapter: str | None) -> list[tuple[int, list[int]]]:
        """(key, tokens) of the saved KV computed under ``adapter``."""
        return [(key, tokens) for key, tokens in self.saved.items()
                if self._saved_adapter.get(key) == adapter]

    def _wanted(self, entries: Callable[[str | None], Iterable[tuple[int, list[int]]]]
                ) -> set[int]:
        """The keys of ``entries(adapter)`` (retained slots, or saved KV, of an adapter)
        that a waiting sequence would reuse. Only the sequences next in line count (as many
        as can run at once): a long queue must not make every admission slow."""
        by_adapter: dict[str | None, list[tuple[int, list[int]]]] = {}
        wanted = set()
        for seq in itertools.islice(self._waiting, self.num_slots):
            if seq.num_prompt_tokens > MIN_REUSE_TOKENS and not seq.scores_prompt:
                lora = seq.params.lora
                if lora not in by_adapter:
                    by_adapter[lora] = list(entries(lora))
                match = best_match(seq.prompt_token_ids, by_adapter[lora], seq.min_last_chunk)
                if match is not None:
                    wanted.add(match[0])
        return wanted

    def _evict(self, slot: int, save: bool = True) -> None:
        """Drop a retained slot's KV (the backend drops its stream) and free the slot; with
        ``save``, the KV is kept in host memory first, where there is room for it."""
        adapter = self.prefix.adapter(slot)
        tokens = self._drop_retained(slot)
        if save:
            self._save(slot, tokens, adapter)
        self._free_slots.append(slot)
        self._ops.append(DropStream(slot))

    def _drop_retained(self, slot: int) -> list[int]:
        del self._retained_blocks[slot]
        return self.prefix.take(slot)

    def _save(self, slot: int, tokens: list[int], adapter: str | None) -> None:
        """Copy an evicted stream's KV (computed under ``adapter``) to host memory. Saved
        texts of the same adapter this one holds in full are forgotten, then the least
        recently saved KV that no waiting request would restore, until there is room; when
        only wanted KV is left, this one is not saved (what is saved serves requests
        waiting now, this one none yet)."""
        if not MIN_REUSE_TOKENS < len(tokens) <= self.saved_capacity:
            return
        victims = []
        for key, held in self._saved_entries(adapter):
            shared = common_prefix_len(tokens, held)
            if shared == len(tokens):  # already saved, in full
                return
            if shared == len(held):
                victims.append(key)
        room = self.saved_capacity - self.num_saved_tokens
        room += sum(len(self.saved[key]) for key in victims)
        if room < len(tokens):
            wanted = self._wanted(self._saved_entries)
            for key, held in self.saved.items():
                if room >= len(tokens):
                    break
                if key not in wanted and key not in victims:
                    victims.append(key)
                    room += len(held)
        if room < len(tokens):
            return
        for key in victims:
            self._forget(key)
        key = next(self._keys)
        self.saved[key] = tokens
        self._saved_adapter[key] = adapter
        self.num_saved_tokens += len(tokens)
        self._ops.append(SaveStream(slot, key))

    def _take_saved(self, key: int) -> None:
        """Saved KV about to be restored: it leaves the host cache (its stream holds it)."""
        self._saved_adapter.pop(key, None)
        self.num_saved_tokens -= len(self.saved.pop(key))

    def _forget(self, key: int) -> None:
        self._take_saved(key)
        self._ops.append(ForgetSaved(key))

    def _best_prefix(self, seq: Request) -> tuple[tuple[int, int] | None,
                                                   tuple[int, int] | None]:
        """The longest prefix of ``seq``'s prompt held by a stream (slot, tokens), and by
        saved KV (key, tokens)."""
        if seq.num_prompt_tokens <= MIN_REUSE_TOKENS or not max_reuse_tokens(
                seq, self.prefix_caching):
            return None, None  # too short to reuse, or it needs every position's logits
        lora = seq.params.lora
        live = ((self._slot[s.seq_id], s.computed_token_ids) for s in self._running
                if s.num_computed and s.seq_id in self._slot and s.params.lora == lora)
        prompt = seq.prompt_token_ids
        tail = seq.min_last_chunk
        return (best_match(prompt, itertools.chain(self.prefix.entries(lora), live), tail),
                best_match(prompt, self._saved_entries(lora), tail))
