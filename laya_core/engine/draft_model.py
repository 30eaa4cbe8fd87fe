"""Speculative decoding with a draft model: a smaller model of the same vocabulary guesses a
sequence's next tokens, and the model checks them in one step.

The draft model is a second backend of the replica's kind, loaded by the engine beside the
model (:func:`load`), with a KV stream per sequence in its own pool (planned:
``memory.planner``). Before each step, :meth:`DraftModel.prepare` brings every decoding
sequence's stream up to its text (the tokens since the first one its stream disagrees with:
the whole prompt the first time, a bounded chunk a step, then the last sampled token, and any
draft tokens the model did not keep are dropped), then decodes greedily, all sequences in one batch a round, as many
rounds as the longest draft asks. The step plan takes each sequence's draft as it takes a
prompt lookup's (``step_plan``), and the backend verifies it the same way: a draft is a
proposal of probability 1, so keeping the tokens the model itself samples is exact, greedy
or sampled (laya_core/engine/speculative.py).

A draft's length follows what was kept: doubled (up to ``num_speculative_tokens``) when
kept whole, else one more than what was kept.

A draft backend of the streams layout (llama.cpp) keeps a stream per slot and trims it
itself. One of the paged layout (torch) is handed its blocks by the draft model
(:class:`_Blocks`): a slot's table grows with what it is fed and shrinks when it is trimmed.
Its pool holds as many tokens as the model's, but a draft shares no prefix and runs a draft
ahead, so it can run short; a sequence that finds no block then goes without a draft this
step, which costs speed, never a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from laya_core.backend import Backend, ModelConfig, StepItem
from laya_core.engine.speculative import drafts_at
from laya_core.kv.prefix import common_prefix_len
from laya_core.types import SamplingParams, SpeculativeConfig

if TYPE_CHECKING:
    from laya_core.engine.request import Request

_GREEDY = SamplingParams(temperature=0.0)


def draft_config(sizes: ModelConfig) -> ModelConfig:
    """The draft model's config: the model's decided sizes (its pool, sequences and step),
    its backend and options, the draft's file, and nothing else of the model's."""
    spec = sizes.speculative
    assert spec is not None and spec.model is not None
    return attrs.evolve(sizes, name=f"{sizes.name} (draft)", path=spec.model,
                        speculative=None, lora={}, max_loras=None, embeddings=False)


class _Blocks:
    """A paged draft backend's pool, handed out per slot: ``tables[slot][i]`` holds the
    slot's positions ``i * block_size ..``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}

    def cover(self, slot: int, num_tokens: int) -> list[int] | None:
        """The slot's table, grown to hold positions ``0 .. num_tokens - 1``; None (and the
        table as it was) when the pool has too few blocks left."""
        table = self.tables.setdefault(slot, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            return None
        table += [self._free.pop() for _ in range(need)]
        return table

    def trim(self, slot: int, num_tokens: int) -> None:
        """The slot's blocks past position ``num_tokens - 1`` go back to the pool."""
        table = self.tables.setdefault(slot, [])
        keep = -(-num_tokens // self.block_size)
        self._free += reversed(table[keep:])
        del table[keep:]


class DraftModel:
    """The draft backend and which of its slots each sequence holds."""

    def __init__(self, backend: Backend, max_num_seqs: int, max_seq_len: int,
                 max_step_tokens: int, kv_tokens: int = 0) -> None:
        self.backend = backend
        # The paged layout's blocks (module docstring); None where the backend keeps streams.
        self._blocks = _Blocks(kv_tokens // backend.block_size, backend.block_size) \
            if backend.kv_layout == "paged" else None
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._fed: dict[int, list[int]] = {}  # slot -> the tokens its KV holds
        self._max_seq_len = max_seq_len
        self._step_tokens = max_step_tokens
        # What one sequence's first row of a round may feed (a draft kept whole and the
        # model's token after it are two): every sequence's fits a step together.
        self._tail = max(1, min(8, max_step_tokens // max_num_seqs))
        # The catch-up (a new sequence's prompt) one step may feed, all sequences together:
        # a long prompt is fed over several steps, and the running sequences' steps go on
        # meanwhile (a 400-token prompt is 3.4 s of the embedded model's compute as a
        # draft on an AMX Xeon, whose llama.cpp runs Q4_1 rows without repacking).
        self._catch_up_budget = max(self._tail, max_step_tokens // 16)

    def take_slot(self) -> int:
        slot = self._free.pop()
        self._fed[slot] = []
        self.backend.start_sequence(slot, _GREEDY)
        return slot

    def give_back(self, slot: int) -> None:
        self.backend.free_sequence(slot)
        if self._blocks is not None:
            self._blocks.trim(slot, 0)
        del self._fed[slot]
        self._free.append(slot)

    def _trim(self, slot: int, num_tokens: int) -> None:
        if self._blocks is not None:
            self._blocks.trim(slot, num_tokens)  # what the KV holds past it is fed again
        else:
            self.backend.trim_sequence(slot, num_tokens)

    def _item(self, slot: int, tokens: list[int], start: int, sample: bool) -> StepItem | None:
        """Feed ``tokens`` to ``slot`` from ``start``; None where its blocks do not fit."""
        if self._blocks is None:
            return StepItem(slot, tokens, start, sample)
        table = self._blocks.cover(slot, start + len(tokens))
        return None if table is None else StepItem(slot, tokens, start, sample,
                                                   block_table=tuple(table))

    def prepare(self, running: Sequence[Request]) -> None:
        """Draft for every decoding sequence with a :class:`ModelDrafter` (module docstring),
        unless the step runs more sequences than ``disable_by_batch_size``."""
        drafters = []
        for seq in running:
            drafter = seq.drafter
            if isinstance(drafter, ModelDrafter) and not drafts_at(drafter.config, len(running)):
                drafter.ready = []
            elif isinstance(drafter, ModelDrafter) and not seq.is_prefilling \
                    and seq.output_token_ids:
                drafter.ready = []
                room = self._max_seq_len - seq.num_prompt_tokens - len(seq.output_token_ids)
                if drafter.length > 0 and room > 1:
                    drafters.append((drafter, [*seq.prompt_token_ids, *seq.output_token_ids],
                                     min(drafter.length, room - 1)))
        budget = self._catch_up_budget
        ready = []
        for drafter, tokens, k in drafters:
            item, budget = self._catch_up(drafter, tokens, budget)
            if item is not None:
                ready.append((drafter, item, k))
        if not ready:
            return
        drafters = [(d, [], k) for d, _, k in ready]
        items = [item for _, item, _ in ready]
        rounds = max(k for _, _, k in drafters)
        active = list(range(len(drafters)))
        for r in range(rounds):
            results = self.backend.step([items[i] for i in active])
            nxt = []
            for i, result in zip(active, results, strict=True):
                drafter, _, k = drafters[i]
                assert result.sample is not None
                token = result.sample.token_id
                drafter.ready.append(token)
                item = items[i]
                self._fed[drafter.slot].extend(item.tokens)
                if r + 1 < k:
                    following = self._item(drafter.slot, [token],
                                           item.start_pos + len(item.tokens), True)
                    if following is not None:
                        items[i] = following
                        nxt.append(i)
            active = nxt
            if not active:
                break

    def _catch_up(self, drafter: ModelDrafter, tokens: list[int],
                  budget: int) -> tuple[StepItem | None, int]:
        """The item that feeds the slot what its KV lacks of ``tokens`` and samples the first
        draft token, and what is left of the step's catch-up ``budget``. A long catch-up (a
        prompt) is fed first, a chunk of at most ``budget`` tokens a step, so that every
        sequence's item fits one step together; None while it is not fed whole."""
        if drafter.slot < 0:
            drafter.slot = self.take_slot()
        slot, fed = drafter.slot, self._fed[drafter.slot]
        keep = min(common_prefix_len(fed, tokens), len(tokens) - 1)
        if keep < len(fed):
            self._trim(slot, keep)
            del fed[keep:]
        if len(tokens) - keep > self._tail:
            chunk = tokens[keep:min(keep + min(budget, self._step_tokens), len(tokens) - 1)]
            item = self._item(slot, chunk, keep, False) if chunk else None
            if item is not None:
                self.backend.step([item])
                fed.extend(chunk)
                keep += len(chunk)
                budget -= len(chunk)
            if len(tokens) - keep > self._tail:
                return None, budget
        return self._item(slot, tokens[keep:], keep, True), budget

    def close(self) -> None:
        self.backend.close()


class ModelDrafter:
    """One sequence's drafts from the draft model: what :meth:`DraftModel.prepare` made for
    this step, cut to the room the step plan gives."""

    def __init__(self, model: DraftModel, config: SpeculativeConfig) -> None:
        self.model = model
        self.config = config
        self.slot = -1  # taken on the engine thread, at the first draft
        self.length = config.num_speculative_tokens  # the next draft's length, at most
        self._max = config.num_speculative_tokens
        self.ready: list[int] = []

    def draft(self, output: list[int], limit: int) -> list[int]:
        return self.ready[:max(0, limit)]

    def accepted(self, num_draft: int, num_accepted: int) -> None:
        if num_draft and num_accepted == num_draft:
            self.length = min(self._max, 2 * num_draft)
        elif num_draft:
            self.length = num_accepted + 1

    def close(self) -> None:
        """The sequence ended: its slot goes back (on the engine thread)."""
        if self.slot >= 0:
            self.model.give_back(self.slot)
            self.slot = -1


def load(sizes: ModelConfig, backend_cls: type[Backend], vocabulary: Sequence[bytes]) -> DraftModel:
    """The draft model of ``sizes.speculative``, loaded with a pool like the model's; a
    draft of another vocabulary (``vocabulary``: the model's tokens' bytes) is refused."""
    config = draft_config(sizes)
    backend = backend_cls(config)
    try:
        backend.load_weights()
        tokenizer = backend.tokenizer()
        if tokenizer.vocab_size != len(vocabulary) or any(
                tokenizer.token_bytes(i) != b for i, b in enumerate(vocabulary)):
            raise ValueError(f"the draft model {config.path} has another vocabulary than the "
                             "model's: a draft must share the model's tokenizer")
        assert config.kv_cache_tokens and config.max_num_seqs
        backend.allocate_kv(num_tokens=config.kv_cache_tokens, max_num_seqs=config.max_num_seqs)
    except BaseException:
        backend.close()
        raise
    assert config.max_seq_len
    return DraftModel(backend, config.max_num_seqs, config.max_seq_len, config.max_step_tokens,
                      config.kv_cache_tokens)
