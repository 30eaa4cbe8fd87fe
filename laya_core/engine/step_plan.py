"""The plan of one engine step: what each sequence feeds, where, and the KV work before it.

A scheduler's policy orders the running sequences (who goes first) and admits waiting ones;
:func:`build_plan` cuts the step's token budget into chunks in that order and collects the
KV cache's operations, so that a scheduler writes policy only. The engine applies
``plan.ops`` in order, then runs ``plan.items()`` in one batched step.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from laya_core.backend import StepItem
from laya_core.engine.allowed_tokens import AllowedTokens
from laya_core.engine.request import Request
from laya_core.engine.speculative import drafts_at
from laya_core.kv.policies import KVCache, KVOp


@attrs.frozen
class PlannedChunk:
    """Part of one sequence's work in a step: feed ``tokens`` at ``start_pos ..``."""

    seq: Request = attrs.field(eq=False)
    tokens: tuple[int, ...]
    start_pos: int
    seq_id: int  # the backend's name for the sequence (KVCache.handle)
    block_table: tuple[int, ...] = ()  # paged layouts: the blocks of positions 0 ..
    # A decoding sequence's drafted next tokens, fed after ``tokens`` for the model to check
    # (laya_core/engine/speculative.py); not the sequence's tokens unless it keeps them.
    draft: tuple[int, ...] = ()
    # A constrained sequence's masks for its sampled rows, where it has a draft: the next
    # token's, then one after each draft token (Request.allowed_along); () otherwise.
    masks: tuple[AllowedTokens | None, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a new token is sampled."""
        return self.start_pos + len(self.tokens) == self.seq.num_tokens

    def item(self) -> StepItem:
        """What the backend is asked: the tokens to feed, the prompt tokens to score, and
        the tokens the sampled one may be."""
        seq, samples = self.seq, self.samples
        allowed = None
        if samples:
            allowed = self.masks[0] if self.masks else seq.allowed_tokens()
        return StepItem(self.seq_id, self.tokens + self.draft, self.start_pos, samples,
                        seq.score_targets(self.start_pos, len(self.tokens)),
                        seq.params.prompt_logprobs or 0, block_table=self.block_table,
                        allowed_tokens=allowed, draft=self.draft,
                        draft_allowed=self.masks[1:])


@attrs.frozen
class StepPlan:
    """One step, immutable: the KV operations to apply first, then the chunks to run."""

    ops: tuple[KVOp, ...]
    chunks: tuple[PlannedChunk, ...]

    def items(self) -> list[StepItem]:
        return [c.item() for c in self.chunks]


def build_plan(kv: KVCache, order: Iterable[Request], max_step_tokens: int,
               max_scored_tokens: int) -> StepPlan:
    """Chunks for the sequences in ``order`` within the step's budgets, with ``kv``'s ops.

    A prompt whose log-probabilities are wanted shares ``max_scored_tokens`` a step (each
    scored row needs a row of logits, counted in the memory plan). A sequence whose only
    chunk would leave one lone last prompt token waits (``Request.tokens_to_compute``). A
    decoding sequence with a drafter feeds its draft too, inside the budget, and never past
    the room it was admitted with (``Request.max_total_tokens``); a constrained one only as
    far as its constraint allows each draft token, with the mask of every row it samples.
    """
    budget, scored = max_step_tokens, max_scored_tokens
    chunks: list[PlannedChunk] = []
    order = list(order)
    for seq in order:
        if budget == 0:
            break
        scoring = seq.scores_prompt and seq.is_prefilling
        tokens = seq.tokens_to_compute(min(budget, scored) if scoring else budget)
        if tokens:
            draft: tuple[int, ...] = ()
            if seq.drafter is not None and not seq.is_prefilling and budget > 1 \
                    and drafts_at(seq.drafter.config, len(order)):
                # k drafts and the token after them: at most max_total_tokens in all.
                room = min(budget - 1, seq.max_total_tokens - seq.num_tokens - 1)
                draft = tuple(seq.drafter.draft(seq.output_token_ids, room))
            masks: tuple[AllowedTokens | None, ...] = ()
            if draft and seq.constraint is not None:
                masks = seq.allowed_along(draft)
                draft = draft[:len(masks) - 1]
            chunks.append(PlannedChunk(seq, tuple(tokens), seq.num_computed, kv.handle(seq),
                                       kv.block_table(seq), draft, masks))
            budget -= len(tokens) + len(draft)
            scored -= len(tokens) if scoring else 0
    return StepPlan(kv.take_ops(), tuple(chunks))
