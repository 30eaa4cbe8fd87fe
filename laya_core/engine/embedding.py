"""The engine's embedding path: an embed request queued from the event loop, and the
embedding pass the engine thread runs after each step.

An embed request waits in the engine's inbox beside generation requests and takes a place in
the same queue (``Engine._take_place``). On the engine thread it joins the replica's
:class:`~laya_core.engine.embed_queue.EmbedQueue`, which plans one pass after each step in
what the step left of its token budget (``embed_budget``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from laya_core.engine.embed_jobs import (
    EmbedCancel,
    Embeddings,
    EmbeddingsUnsupportedError,
    EmbedJob,
)
from laya_core.engine.embed_queue import embed_budget
from laya_core.engine.layer_clock import LOOP, now_ns
from laya_core.engine.limits import RequestTooLongError
from laya_core.engine.state import EngineState, EngineUnavailableError

if TYPE_CHECKING:
    from laya_core.engine.engine import Engine

# Its lines are the engine's, under the logger name they have always had.
log = logging.getLogger("laya_core.engine.engine")


def queue_embed(engine: Engine, inputs: list[list[int]],
                loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[Embeddings]:
    """``Engine.embed``: check the request, take its place in the queue, and put it in the
    engine's inbox; cancelling the returned future puts its cancel there too."""
    if engine.state is not EngineState.READY:
        raise EngineUnavailableError(
            f"{engine.config.name} replica {engine.replica_id} is {engine.state.value}")
    if not engine.backend.supports_embeddings:
        raise EmbeddingsUnsupportedError(
            f"the {engine.backend.name} backend cannot compute embeddings")
    if not engine.config.embeddings:
        raise EmbeddingsUnsupportedError(
            f"embeddings are off for {engine.config.name} (embeddings = true turns them on)")
    if not inputs or not all(inputs):
        raise ValueError("every input must hold at least one token")
    longest = max(map(len, inputs))
    if longest > engine.max_seq_len:
        raise RequestTooLongError(
            f"an input has {longest} tokens, more than this model's max_seq_len of "
            f"{engine.max_seq_len}; shorten it")
    engine._take_place()
    loop = loop or asyncio.get_running_loop()
    job = EmbedJob(inputs, loop, loop.create_future())
    engine._inbox.put(job)

    def cancelled(future: asyncio.Future[Embeddings]) -> None:
        if future.cancelled():
            engine._inbox.put(EmbedCancel(job))

    job.future.add_done_callback(cancelled)
    return job.future


def embed_next(engine: Engine) -> None:
    """One embedding pass after a step, of a quarter of the step's token budget
    (``embed_budget``): a decoding sequence, or a request in the inbox, waits at most
    that much embedding work."""
    embeds = engine._embeds
    assert embeds is not None and engine.sizes is not None
    start = now_ns()
    plan = embeds.plan(embed_budget(engine.sizes.max_step_tokens))
    engine.clock.add(LOOP, start)  # the pass itself is no token's time
    if plan is None:
        return
    engine._flush()  # this step's tokens go out before the embedding runs
    engine.embed_passes += 1
    engine.embedded_tokens += plan.num_tokens
    try:
        vectors = engine.backend.embed_step(plan)
    except Exception as e:  # noqa: BLE001 - those requests fail, the replica serves on
        log.exception("embedding failed")
        embeds.failed(plan, RuntimeError(f"embedding failed: {type(e).__name__}: {e}"))
        return
    embeds.computed(plan, vectors)
