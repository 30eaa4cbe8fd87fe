"""The engine thread's state of one running request besides its tokens, and what each new
token means for it: the text to send, whether the sequence ends, and its timing."""

from __future__ import annotations

import time
from collections.abc import Collection

import attrs

from laya_core.engine.detokenizer import IncrementalDetokenizer
from laya_core.engine.request import Request
from laya_core.engine.stream import Courier, EventSink
from laya_core.types import FinishReason, Sample, Timing


@attrs.frozen
class TokenOutcome:
    """What one sampled token adds to a request's output."""

    text: str
    finish: FinishReason | None  # None: the sequence goes on
    samples: tuple[Sample, ...]  # the token with its log-probabilities, when asked for
    prompt_logprobs: tuple[Sample, ...]  # the prompt's scores, sent with the first token


@attrs.define(eq=False)
class Live:
    """Where a sequence's events go, its text so far, and when its tokens came."""

    seq: Request
    loop: Courier  # an event loop, or a transport's (laya_core/engine/stream.py)
    queue: EventSink
    detokenizer: IncrementalDetokenizer
    started: bool = False  # admitted and known to the backend
    last_token_time: float = 0.0  # perf_counter seconds
    token_gaps: list[float] = attrs.field(factory=list)  # seconds between successive tokens
    # Prompt log-probabilities scored so far, sent with the first token.
    prompt_logprobs: list[Sample] = attrs.field(factory=list)

    def add_token(self, sample: Sample, eog_token_ids: Collection[int],
                  max_seq_len: int) -> TokenOutcome:
        """Record a sampled token: its time, its text (stop strings held back), and whether
        it ends the sequence (end of generation, a stop token or string, or a length)."""
        seq, token, params = self.seq, sample.token_id, self.seq.params
        samples = (sample,) if params.logprobs is not None else ()
        prompt: tuple[Sample, ...] = ()
        if self.prompt_logprobs and not seq.output_token_ids:
            prompt, self.prompt_logprobs = tuple(self.prompt_logprobs), []
        seq.output_token_ids.append(token)
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        else:
            self.token_gaps.append(now - self.last_token_time)
        self.last_token_time = now
        finish: FinishReason | None = None
        if (token in eog_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            text, finish = self.detokenizer.flush(), FinishReason.STOP
        else:
            text, stopped = self.detokenizer.add(token)
            if stopped:
                finish = FinishReason.STOP
            elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_seq_len:
                text, finish = text + self.detokenizer.flush(), FinishReason.LENGTH
        return TokenOutcome(text, finish, samples, prompt)

    def timing(self) -> Timing:
        """Where the sequence's time went, as far as it has come."""
        seq = self.seq
        end = seq.finished_time or time.perf_counter()
        admitted = seq.admitted_time or end
        first = seq.first_token_time or end
        return Timing(queue_s=admitted - seq.arrival_time, prefill_s=first - admitted,
                      decode_s=end - first, token_gaps_s=tuple(self.token_gaps),
                      draft_tokens=seq.num_draft_tokens, accepted_tokens=seq.num_accepted_tokens)
