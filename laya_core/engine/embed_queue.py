"""A replica's embed requests, planned into passes that share the step's token budget.

The engine asks for one :class:`~laya_core.engine.embed_jobs.EmbedPlan` after each step, of at most
:func:`embed_budget` tokens (a quarter of ``max_step_tokens``). The plan continues the
inputs already begun, oldest first, then begins the next inputs of the waiting requests in
the order they came, while the backend has a free embedding sequence
(``Backend.max_embed_inputs``) and room for the whole input: at most ``capacity_tokens``
(the replica's ``max_seq_len``, what the backend's embedding memory holds) of begun inputs
at once. A long input is cut into chunks across plans; short ones share a plan, so 2,048
one-token inputs take a few passes rather than 2,048. A backend that cannot take chunks
(``Backend.embeds_in_chunks`` False) gets whole inputs, one per plan.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from laya_core.engine.embed_jobs import EmbedChunk, EmbedJob, EmbedPlan

# Embedding passes are a quarter (1 / SHARE) of a step's token budget, after every step:
# generation is interactive and embedding is batch work, so a decoding sequence waits a
# quarter of a step's budget of embedding between two of its tokens rather than all of it,
# and a request that arrives (a chat, a cancel) waits at most one such pass. It costs the
# embedding nothing measurable: a 1,024-token input took 3.5 s of CPU on the torch backend
# in 128-token passes as in 512-token ones, and llama.cpp feeds 128-token batches anyway.
SHARE = 4


def embed_budget(max_step_tokens: int) -> int:
    """Tokens one embedding pass may feed."""
    return max(max_step_tokens // SHARE, 1)


@attrs.define(eq=False)
class _Begun:
    """An input the backend holds part of, as embedding sequence ``seq``."""

    job: EmbedJob
    index: int
    seq: int
    num_fed: int = 0

    @property
    def tokens(self) -> Sequence[int]:
        return self.job.inputs[self.index]


class EmbedQueue:
    """The embed requests of one replica; see the module docstring. ``release`` is called
    once for each request that leaves (done, failed or cancelled)."""

    def __init__(self, capacity_tokens: int, max_inputs: int, in_chunks: bool,
                 release: Callable[[], None]) -> None:
        self.capacity_tokens = capacity_tokens
        self._in_chunks = in_chunks
        self._release = release
        self._jobs: collections.deque[EmbedJob] = collections.deque()
        self._begun: dict[int, _Begun] = {}  # by sequence, oldest first
        self._free = list(range(max(1, max_inputs) - 1, -1, -1))  # popped lowest first
        self._reserved = 0  # tokens of the begun inputs, whole
        self._dropped: list[int] = []  # sequences to forget in the next plan

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbedJob) -> None:
        self._jobs.append(job)

    def cancel(self, job: EmbedJob) -> None:
        """Drop what is left of ``job`` (its caller went away); nothing if it has left."""
        if job in self._jobs:
            self._remove(job)

    def plan(self, budget: int) -> EmbedPlan | None:
        """The next pass, of at most ``budget`` tokens (a whole input may exceed it on a
        backend without chunks); None when nothing is to be fed."""
        for job in [j for j in self._jobs if j.done]:  # cancelled while it waited
            self._remove(job)
        chunks: list[EmbedChunk] = []
        for begun in self._begun.values():
            if budget <= 0:
                break
            chunks.append(self._chunk(begun, budget))
            budget -= len(chunks[-1].tokens)
        while budget > 0 and (new := self._begin(budget, bool(chunks))) is not None:
            chunks.append(self._chunk(new, budget))
            budget -= len(chunks[-1].tokens)
        if not chunks:
            return None
        dropped, self._dropped = tuple(self._dropped), []
        return EmbedPlan(tuple(chunks), dropped)

    def computed(self, plan: EmbedPlan, vectors: Sequence[Any]) -> None:
        """The backend ran ``plan``: ``vectors`` holds each last chunk's pooled vector."""
        for chunk, vector in zip(plan.chunks, vectors, strict=True):
            begun = self._begun[chunk.seq]
            begun.num_fed += len(chunk.tokens)
            if chunk.last:
                self._end(begun)
                begun.job.finish_input(begun.index, vector)
        for job in [j for j in self._jobs if j.done]:
            self._remove(job)

    def failed(self, plan: EmbedPlan, error: BaseException) -> None:
        """The backend could not run ``plan``: the requests it fed fail; the rest go on."""
        jobs = {self._begun[c.seq].job for c in plan.chunks}
        for job in [j for j in self._jobs if j in jobs]:
            job.fail(error)
            self._remove(job)

    def fail_all(self, error: BaseException) -> None:
        for job in list(self._jobs):
            job.fail(error)
            self._remove(job)

    # -- bookkeeping ------------------------------------------------------------------------

    def _begin(self, budget: int, others: bool) -> _Begun | None:
        """The next input to begin, oldest request first, or None when none may begin."""
        job = next((j for j in self._jobs if j.num_admitted < len(j.inputs)), None)
        if job is None or not self._free:
            return None
        size = len(job.inputs[job.num_admitted])
        if self._reserved + size > self.capacity_tokens:
            return None
        if not self._in_chunks and others and size > budget:
            return None  # a whole input larger than what is left goes in a plan of its own
        begun = _Begun(job, job.num_admitted, self._free.pop())
        job.num_admitted += 1
        self._reserved += size
        self._begun[begun.seq] = begun
        return begun

    def _chunk(self, begun: _Begun, budget: int) -> EmbedChunk:
        tokens = begun.tokens
        end = len(tokens) if not self._in_chunks else min(len(tokens), begun.num_fed + budget)
        return EmbedChunk(begun.seq, tuple(tokens[begun.num_fed:end]), begun.num_fed,
                          end == len(tokens))

    def _end(self, begun: _Begun) -> None:
        del self._begun[begun.seq]
        self._reserved -= len(begun.tokens)
        self._free.append(begun.seq)
        self._free.sort(reverse=True)

    def _remove(self, job: EmbedJob) -> None:
        """``job`` leaves the queue; the backend forgets its begun inputs in the next plan."""
        for begun in [b for b in self._begun.values() if b.job is job]:
            self._end(begun)
            self._dropped.append(begun.seq)
        self._jobs.remove(job)
        self._release()
