"""The engine client: everything the HTTP side touches of one replica.

The HTTP side runs on an asyncio loop; a replica's engine runs on a thread of its own, in this
process today and in a worker process or on another machine later. Between the two only plain,
immutable data passes: token ids and :class:`SamplingParams` in, :class:`TokenEvent` objects
out (the final one carrying the sequence's :class:`Usage`), :class:`ReplicaInfo` and
:class:`ReplicaSnapshot` for limits, ``/ready`` and ``/metrics``. No object that one
side changes is read by the other. :class:`EngineClient` is the contract a transport
implements; :class:`LocalEngineClient` is the in-process one.

``submit`` raises :class:`RequestTooLongError` (the request can never fit one sequence),
:class:`QueueFullError` (retry later), :class:`EngineUnavailableError` (loading, failed or
stopped), :class:`UnsupportedParameterError` (a field its backend cannot honour: a 400 naming
it) or ``ValueError`` (a request this replica cannot serve); a transport raises the same.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from laya_core.backend import ModelInfo
from laya_core.engine.embed_jobs import Embeddings, EmbeddingsUnsupportedError
from laya_core.engine.engine import Engine
from laya_core.engine.layer_clock import BACKEND, PREFILL, LayerClock
from laya_core.engine.limits import RequestTooLongError
from laya_core.engine.state import (
    EngineState,
    EngineUnavailableError,
    QueueFullError,
    QueueTimeoutError,
    UnsupportedParameterError,
)
from laya_core.engine.stream import GenerationStream
from laya_core.kv.hashing import BLOCK_SIZE
from laya_core.models.tokenizer import Tokenizer
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.spec import ConstraintSpec, GrammarError
from laya_core.types import FinishReason, SamplingParams

__all__ = ["EngineClient", "EngineState", "EngineUnavailableError", "GrammarError",
           "LocalEngineClient",
           "QueueFullError", "QueueTimeoutError", "ReplicaInfo", "ReplicaSnapshot", "RequestTooLongError",
           "UnsupportedParameterError"]


@attrs.frozen
class ReplicaInfo:
    """What a loaded replica serves; fixed from the end of its load on."""

    model: str
    replica_id: int
    backend_name: str  # the backend's registered name
    max_seq_len: int  # tokens one sequence may hold, prompt and output together
    max_queue: int  # requests that may wait for room; 0: none wait, the rest get 429
    supports_prompt_logprobs: bool
    model_info: ModelInfo  # vocabulary size, chat template, BOS/EOS and special-token texts
    # Whether the backend can embed at all (Backend.supports_embeddings); the model's
    # manifest entry may still leave embeddings off (supports_embeddings() says both).
    backend_embeds: bool = False
    block_size: int = BLOCK_SIZE  # tokens per KV block (Backend.block_size)


@attrs.frozen
class ReplicaSnapshot:
    """A replica's state and counters at one moment, for ``/ready``, ``/live`` and
    ``/metrics``. (Whether the router sends it requests is another thing, the router's
    :class:`~laya_core.routing.router.ReplicaState`.)"""

    model: str
    replica_id: int
    state: EngineState
    error: str | None  # why the load failed
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int  # reserved by live sequences
    kv_cached_tokens: int  # kept for prefix reuse, freed whenever needed
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_tokens_reused: int  # of those, found (not prefilled)
    prefix_hits: int  # sequences that reused cached KV
    finished: Mapping[FinishReason, int]  # sequences ended, by reason
    rejections: Mapping[str, int]  # requests refused, by reason
    # Tokens sampled since the replica (its worker, after a restart) started.
    generated_tokens: int = 0
    # Input tokens fed to embedding passes since then (a cancelled request's stop growing).
    embedded_tokens: int = 0
    # Seconds per layer on the replica's side since then (laya_core/engine/layer_clock.py),
    # and the engine steps that ran the backend.
    layer_seconds: Mapping[str, float] = attrs.field(factory=dict)
    num_steps: int = 0
    # Speculative decoding since then: drafts checked, their tokens, and those kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool reserved by live sequences."""
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


def info_of(engine: Engine) -> ReplicaInfo:
    """What a loaded engine serves (its thread writes these before it leaves LOADING)."""
    assert engine.info is not None
    return ReplicaInfo(
        model=engine.config.name, replica_id=engine.replica_id,
        backend_name=engine.backend.name, max_seq_len=engine.max_seq_len,
        max_queue=engine.config.max_queue,
        supports_prompt_logprobs=engine.backend.supports_prompt_logprobs,
        model_info=engine.info, backend_embeds=engine.backend.supports_embeddings,
        block_size=engine.backend.block_size)


class EngineClient(abc.ABC):
    """One replica as the HTTP side sees it. Call it from the event loop that reads the
    streams; ``tokenizer()``'s methods may also run on worker threads."""

    def __init__(self, model: str, replica_id: int) -> None:
        self.model = model
        self.replica_id = replica_id
        # The front end's layers of this replica's tokens (ipc_receive, http); the
        # replica's own come in its snapshots' layer_seconds.
        self.clock = LayerClock()

    @abc.abstractmethod
    def state(self) -> ReplicaSnapshot:
        """A snapshot of the replica's state and counters; cheap enough to call per request."""

    @abc.abstractmethod
    def info(self) -> ReplicaInfo:
        """What the loaded replica serves; raises :class:`EngineUnavailableError` until the
        load succeeded."""

    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, safe from any thread; raises
        :class:`EngineUnavailableError` until the load succeeded."""

    @abc.abstractmethod
    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        """Queue a request; its events arrive on the returned stream, read from this loop.
        Raises at once what is known at once (see the module's docstring), and
        :class:`GrammarError` for a ``constraint`` that does not compile. The transport
        compiles ``constraint`` on its side of the boundary, never on the engine thread."""

    @abc.abstractmethod
    def cancel(self, request_id: int) -> None:
        """End a request at the next step (its final event says CANCELLED); a request
        already finished is left alone."""

    def runtime(self) -> dict[str, Any]:
        """How the replica's backend runs (``Backend.describe``), plain JSON values."""
        return {}

    def supports_embeddings(self) -> bool:
        """Whether the replica's backend computes embeddings (``Backend.supports_embeddings``);
        raises :class:`EngineUnavailableError` until the load succeeded."""
        return False

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        """The unit-length embedding of each input (token ids, each at most max_seq_len and
        inside the vocabulary). Raises :class:`EmbeddingsUnsupportedError` where the backend
        cannot embed, and what ``submit`` raises (see the module's docstring). Cancelling
        the call (its HTTP client went away) stops the replica's work on it."""
        raise EmbeddingsUnsupportedError(f"{self.model} replica {self.replica_id} cannot "
                                         "compute embeddings")

    async def adapter(self, op: str, name: str, path: str | None = None) -> None:
        """Load (``op`` "load", from the PEFT folder ``path``) or unload LoRA adapter
        ``name`` on the replica (laya_core/engine/adapters.py): a load between two steps,
        an unload once no request of the replica uses it. Raises what the backend raised."""
        raise NotImplementedError(f"{self.model} replica {self.replica_id} loads no "
                                  "adapters while serving")


class LocalEngineClient(EngineClient):
    """An :class:`Engine` running on a thread of this process."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.config.name, engine.replica_id)
        self._engine = engine
        self._info: ReplicaInfo | None = None
        self._grammars: GrammarCompiler | None = None

    def state(self) -> ReplicaSnapshot:
        # The engine thread is the only writer of these counters; each read is one int.
        e = self._engine
        return ReplicaSnapshot(
            model=self.model, replica_id=self.replica_id, state=e.state, error=e.error,
            num_running=e.num_running, num_waiting=e.num_waiting,
            kv_capacity_tokens=e.kv_capacity_tokens, kv_used_tokens=e.kv_used_tokens,
            kv_cached_tokens=e.kv_cached_tokens,
            prefix_queried_tokens=e.prefix_queried_tokens,
            prefix_tokens_reused=e.prefix_tokens_reused, prefix_hits=e.prefix_hits,
            generated_tokens=e.generated_tokens, embedded_tokens=e.embedded_tokens,
            finished=dict(e.finished), rejections=dict(e.rejections),
            layer_seconds=e.clock.seconds(),
            num_steps=e.clock.calls[BACKEND] + e.clock.calls[PREFILL],
            spec_drafts=e.speculative.num_drafts,
            spec_draft_tokens=e.speculative.num_draft_tokens,
            spec_accepted_tokens=e.speculative.num_accepted_tokens)

    def info(self) -> ReplicaInfo:
        if self._info is None:
            e = self._engine
            # Written by the engine thread before it leaves LOADING, never again.
            if e.state is EngineState.LOADING or e.info is None or e.tokenizer is None:
                raise EngineUnavailableError(
                    f"{self.model} replica {self.replica_id} is {e.state.value}")
            self._info = info_of(e)
        return self._info

    @property
    def engine(self) -> Engine:
        """The engine this client runs in this process."""
        return self._engine

    def tokenizer(self) -> Tokenizer:
        self.info()  # raises until loaded
        assert self._engine.tokenizer is not None
        return self._engine.tokenizer

    def grammars(self) -> GrammarCompiler:
        """This replica's constraint compiler (and its cache); raises until loaded."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer(), self.info().model_info)
        return self._grammars

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        # The engine copies the ids into its own Request; nothing here is shared.
        ids = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        matcher = None
        if constraint is not None:  # compiled off the engine thread and off this loop
            matcher = await asyncio.to_thread(self.grammars().constraint, constraint)
        return self._engine.submit(ids, params, constraint=matcher)

    def cancel(self, request_id: int) -> None:
        self._engine.cancel(request_id)

    def runtime(self) -> dict[str, Any]:
        return self._engine.runtime()

    def supports_embeddings(self) -> bool:
        self.info()  # raises until loaded
        return self._engine.backend.supports_embeddings and self._engine.config.embeddings

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        # The job keeps lists of its own: nothing the caller holds is read on the engine
        # thread. A cancel of this call cancels the engine's future, which tells the engine.
        return await self._engine.embed([list(ids) for ids in inputs])

    async def adapter(self, op: str, name: str, path: str | None = None) -> None:
        await asyncio.wrap_future(self._engine.adapter(op, name, path))
