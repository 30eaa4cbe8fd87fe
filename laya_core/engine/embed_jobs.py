"""Embeddings: L2 normalization and the engine's embed jobs.

A backend that embeds (``Backend.supports_embeddings``) returns one pooled hidden state per
input (the final norm's output, pooled as the model declares: GGUF ``<arch>.pooling_type``
or a sentence-transformers ``Pooling`` module, read by ``laya_core/models/pooling.py``;
else the last token, which is what a causal
decoder's last position has read). The core normalizes it to unit length, in float64, and
hands it to the HTTP side as little-endian float32 bytes: immutable, and already what
``encoding_format = "base64"`` sends.

Embedding work runs on the replica's engine thread, after each step, in an
:class:`EmbedPlan` of its own of a quarter of the step's token budget
(``laya_core/engine/embed_queue.py``): the inputs of every waiting request, cut into chunks and
batched, so that a decoding sequence waits at most that much embedding. Never
beside a step: the two would share the backend's weights and the same cores, and on a CPU
two thread pools on the same cores slow each other down many times over
(docs/architecture.md, "Threads").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np


class EmbeddingsUnsupportedError(ValueError):
    """The replica's backend cannot compute embeddings."""


def unit_float32(vector: Any) -> bytes:
    """``vector`` scaled to unit L2 norm (computed in float64), as little-endian float32."""
    v = np.asarray(vector, dtype=np.float64).ravel()
    norm = float(np.linalg.norm(v))
    if not np.isfinite(norm):
        raise ValueError("the model's hidden state is not finite")
    if norm > 0:
        v = v / norm
    return v.astype("<f4").tobytes()


def pooled_rows(pooling: str, start: int, num_tokens: int, last: bool) -> range:
    """The rows of a chunk (``num_tokens`` tokens from position ``start``) whose hidden
    states ``pooling`` sums: every row for mean, the input's first token for cls, its last
    token for last."""
    if pooling == "mean":
        return range(num_tokens)
    if pooling == "cls":
        return range(1 if start == 0 else 0)
    return range(num_tokens - 1, num_tokens) if last else range(0)


@attrs.frozen
class Embeddings:
    """What an embed request produced: one unit vector per input, in order."""

    vectors: tuple[bytes, ...]  # little-endian float32, unit L2 norm
    num_tokens: int  # the inputs' tokens, all of them


@attrs.frozen
class EmbedChunk:
    """Tokens of one input to feed: positions ``start`` on, of the backend's embedding
    sequence ``seq`` (0 <= seq < ``Backend.max_embed_inputs``), whose earlier chunks came
    in earlier plans. ``last``: the input ends here, so its pooled vector is wanted and
    ``seq`` is free afterwards."""

    seq: int
    tokens: tuple[int, ...]
    start: int
    last: bool


@attrs.frozen
class EmbedPlan:
    """One embedding pass (``Backend.embed_step``): the sequences to forget first (inputs
    whose request went away, maybe never seen or already forgotten by the backend), then
    the chunks, in order, as one batch."""

    chunks: tuple[EmbedChunk, ...]
    dropped: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


def embed_whole(embed_step: Callable[[EmbedPlan], Sequence[Any]], token_ids: Sequence[int],
                chunk_tokens: int) -> Any:
    """One input's pooled vector through ``embed_step`` (a backend's), in chunks of
    ``chunk_tokens``: ``Backend.embed`` for a backend that embeds in chunks."""
    ids, out = tuple(token_ids), None
    for start in range(0, len(ids), chunk_tokens):
        chunk = ids[start:start + chunk_tokens]
        (out,) = embed_step(EmbedPlan((EmbedChunk(0, chunk, start,
                                                  start + len(chunk) == len(ids)),)))
    return out


@attrs.define(eq=False)
class EmbedJob:
    """One embed request on its way through the engine thread: its inputs, planned by the
    replica's :class:`~laya_core.engine.embed_queue.EmbedQueue`, and the future that gets the
    result on the caller's loop."""

    inputs: Sequence[Sequence[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Embeddings]
    vectors: list[bytes | None] = attrs.field()
    num_admitted: int = 0  # inputs handed to the backend so far (the next one's index)
    num_done: int = 0
    failed: bool = False

    @vectors.default
    def _no_vectors(self) -> list[bytes | None]:
        return [None] * len(self.inputs)

    @property
    def done(self) -> bool:
        return self.num_done == len(self.inputs) or self.failed or self.future.cancelled()

    def finish_input(self, index: int, vector: Any) -> None:
        """Input ``index``'s pooled vector is in; on the engine thread."""
        try:
            self.vectors[index] = unit_float32(vector)
        except ValueError as e:
            self.fail(RuntimeError(f"embedding failed: {e}"))
            return
        self.num_done += 1
        if self.num_done == len(self.inputs):
            vectors = tuple(v for v in self.vectors if v is not None)
            self.resolve(Embeddings(vectors, sum(map(len, self.inputs))))

    def fail(self, error: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.resolve(error)

    def resolve(self, outcome: Embeddings | BaseException) -> None:
        """Hand ``outcome`` to the caller's loop (a result, or an error to raise)."""
        def settle() -> None:
            if self.future.done():  # cancelled: the client went away
                return
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for this request
            pass


@attrs.frozen(eq=False)
class EmbedCancel:
    """For the engine's inbox: ``job``'s caller went away; what is left of it is dropped."""

    job: EmbedJob
