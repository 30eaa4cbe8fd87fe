"""One generation request as the engine sees it: tokens, progress, and its place in the cache."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import attrs

from laya_core.types import FinishReason, SamplingParams

if TYPE_CHECKING:
    from laya_core.engine.allowed_tokens import AllowedTokens, TokenConstraint
    from laya_core.engine.draft_model import ModelDrafter
    from laya_core.engine.speculative import NgramDrafter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """A prompt and what has been generated from it.

    ``num_computed`` counts the leading tokens whose keys and values are in the KV cache. The
    last sampled token is never computed until the next step feeds it, so a decoding sequence
    has exactly one token left to compute and a prefilling one has several.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = attrs.field(factory=time.perf_counter)
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Leading prompt tokens whose KV came from the prefix cache at admission (not computed):
    # what usage.prompt_tokens_details.cached_tokens reports.
    num_cached_tokens: int = 0
    # Timestamps (perf_counter seconds) for per-layer timing.
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Where set (structured output sets it), what this sequence may sample next; see
    # allowed_tokens().
    constraint: TokenConstraint | None = None
    # The fewest prompt tokens the prompt's last chunk holds, unless the prompt is shorter,
    # and so the fewest a prefix reuse leaves to compute: the backend's
    # Backend.min_last_prompt_chunk (1: the token the first output is sampled from).
    min_last_chunk: int = 1
    # Where speculative decoding is on for this sequence, what drafts its next tokens
    # (laya_core/engine/speculative.py); and its drafts' counts, for its timing.
    drafter: NgramDrafter | ModelDrafter | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's log-probabilities are wanted. Such a sequence prefills its
        whole prompt, since KV taken from the prefix cache comes without logits."""
        return self.params.prompt_logprobs is not None

    def score_targets(self, start_pos: int, num_tokens: int) -> list[int]:
        """The prompt tokens that follow positions ``start_pos .. start_pos+num_tokens-1``:
        what a chunk there scores. The last prompt position is followed by a sampled token,
        not a prompt one, so a chunk that ends the prompt scores one fewer than it feeds."""
        if not self.scores_prompt:
            return []
        return self.prompt_token_ids[start_pos + 1 : start_pos + num_tokens + 1]

    def allowed_tokens(self) -> AllowedTokens | None:
        """The tokens allowed as this sequence's next one, or None for any. Asked once before
        each token it samples (so a constraint may advance its matcher over the tokens
        generated since it was last asked)."""
        return None if self.constraint is None else self.constraint(self.output_token_ids)

    def allowed_along(self, draft: tuple[int, ...]) -> tuple[AllowedTokens | None, ...]:
        """The masks of a drafted step's rows under this sequence's constraint (one that
        ``looks_ahead``): the next token's, then the one after each draft token the
        constraint allows where it stands."""
        along = self.constraint.along  # type: ignore[union-attr]
        return tuple(along(self.output_token_ids, draft))

    @property
    def drafts_under_constraint(self) -> bool:
        """Whether drafts can be checked under this sequence's constraint (if it has one)."""
        from laya_core.engine.allowed_tokens import looks_ahead

        return self.constraint is None or looks_ahead(self.constraint)

    @property
    def max_total_tokens(self) -> int:
        """The most KV cache this sequence can ever hold, in tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def computed_token_ids(self) -> list[int]:
        """The tokens whose KV is in the cache, in order."""
        return (self.prompt_token_ids + self.output_token_ids)[: self.num_computed]

    def tokens_to_compute(self, limit: int) -> list[int]:
        """The next tokens to feed the model, at most ``limit`` of them.

        A prompt's last chunk holds at least ``min_last_chunk`` tokens (unless the prompt
        is shorter): a backend whose one-token batch takes other kernel paths (llama.cpp:
        512 + 1 answers otherwise than 511 + 2 or 509 + 4, by 0.004-0.05 in a
        log-probability) says 2. Where fewer would be left, this chunk stops short, or waits
        for a larger budget.
        """
        start = self.num_computed
        if start < self.num_prompt_tokens:
            remaining = self.num_prompt_tokens - start
            n = min(limit, remaining)
            if 0 < remaining - n < self.min_last_chunk:
                n = max(0, remaining - self.min_last_chunk)
            return self.prompt_token_ids[start : start + n]
        out_start = start - self.num_prompt_tokens
        return self.output_token_ids[out_start : out_start + limit]
