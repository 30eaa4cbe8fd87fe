"""Scheduling policy: which sequences are admitted, and in what order they run a step.

A scheduler owns the waiting queue and the running set and decides *who* goes next; the
:class:`~laya_core.kv.policies.KVCache` it is given decides *where* their KV lives, and
:func:`~laya_core.engine.step_plan.build_plan` cuts the step's budget into chunks in the scheduler's
order. A scheduler plugin writes policy only: it inherits no KV bookkeeping. It imports no
model library.
"""

from __future__ import annotations

import abc
import collections
import time
from collections.abc import Iterable

import attrs

from laya_core.engine.request import Request, RequestStatus
from laya_core.engine.step_plan import StepPlan, build_plan
from laya_core.kv.policies import KVCache
from laya_core.memory.ledger import MAX_SCORED_TOKENS_PER_STEP


@attrs.frozen
class SchedulerConfig:
    max_num_seqs: int = attrs.field(validator=attrs.validators.ge(1))
    # Tokens one engine step may feed the model: one per decoding sequence, the rest prefill.
    max_step_tokens: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    # Prompt positions one step may score (prompt log-probabilities): each needs a row of
    # logits, counted in the memory plan (memory_plan.scored_tokens_per_step).
    max_scored_tokens: int = attrs.field(default=MAX_SCORED_TOKENS_PER_STEP,
                                         validator=attrs.validators.ge(1))


class Scheduler(abc.ABC):
    """Chooses the work of each engine step; subclasses implement :meth:`schedule`."""

    def __init__(self, config: SchedulerConfig, kv: KVCache) -> None:
        self.config = config
        self.kv = kv
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        kv.bind(self.waiting, self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Request) -> None:
        """Queue ``seq``. Its length was checked at submit against max_seq_len (the length
        rule, :mod:`laya_core.engine.limits`); this is the KV cache's own bound, which only a
        pool of whole blocks smaller than max_seq_len can refuse."""
        if not self.kv.can_ever_hold(seq.max_total_tokens):
            raise ValueError(
                f"sequence {seq.seq_id} needs {seq.max_total_tokens} tokens of KV cache; "
                f"the pool holds {self.kv.capacity_tokens}"
            )
        self.waiting.append(seq)

    def finish(self, seq: Request, retain: bool = False) -> None:
        """Remove a sequence, waiting or running; a running one gives back its KV, which
        with ``retain`` may stay cached for later prompts (the cache's ops say what the
        backend must do: ``kv.take_ops()``)."""
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
            self.kv.finish(seq, retain)
        elif seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = RequestStatus.FINISHED

    def can_admit(self, seq: Request) -> bool:
        """Whether the KV cache can take ``seq``'s worst case now."""
        return self.kv.can_admit(seq)

    def admit(self, seq: Request) -> None:
        """Move ``seq`` to the running set; the cache gives it room and its cached prefix.
        The caller has removed it from ``waiting``."""
        self.kv.admit(seq)
        seq.status = RequestStatus.RUNNING
        seq.admitted_time = time.perf_counter()
        self.running.append(seq)

    def plan(self, order: Iterable[Request]) -> StepPlan:
        """The step's plan: the running sequences in ``order``, within the step's budgets."""
        self.kv.before_step()
        return build_plan(self.kv, order, self.config.max_step_tokens,
                          self.config.max_scored_tokens)

    @abc.abstractmethod
    def schedule(self) -> StepPlan:
        """Admit what fits and return this step's plan (no chunks: nothing to run)."""


class FcfsScheduler(Scheduler):
    """First come, first served, with decode before prefill and chunked prefill.

    Decoding sequences go first, one token each, so running streams keep flowing; the rest of
    the step's token budget prefills prompts in arrival order, in chunks. A waiting sequence is
    admitted only when its worst case fits in the cache; a head that does not fit blocks those
    behind it, so a long request cannot be starved by a stream of short ones. Prompts whose
    log-probabilities are wanted share a smaller budget too: ``max_scored_tokens`` a step.
    """

    def schedule(self) -> StepPlan:
        while self.waiting and self.can_admit(self.waiting[0]):
            self.admit(self.waiting.popleft())
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        return self.plan(decoding + prefilling)
