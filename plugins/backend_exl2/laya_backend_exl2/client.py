"""One replica: a library's dynamic generator run on a thread of its own, behind Laya's
replica seam.

``submit`` (the event loop) checks the request, takes a place among the replica's running
requests (``max_num_seqs``, which is also the generator's batch) and hands the request to
the generator's thread through an inbox. That thread enqueues jobs, cancels them, and runs
``iterate()`` while any job is left; each token goes through Laya's detokenizer, which holds
back what may be a stop string, and out as a :class:`TokenEvent` (one call per event loop
per iteration). A request ends on a stop token (the generator's stop condition), a stop
string (Laya's detokenizer; the job is then cancelled), ``max_tokens``, the generator's own
end, or its client's cancel. A failure of the generator ends every running request with an
error (``replica_lost``) and marks the replica down; the next load starts it afresh.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from laya_backend_exl2.options import PAGE_TOKENS
from laya_backend_exl2.runtime import LENGTH_REASONS, Output, Runtime, Settings
from laya_backend_exl2.tokenizer import FolderTokenizer, load_tokenizer
from laya_core.backend import ModelConfig
from laya_core.engine.detokenizer import IncrementalDetokenizer
from laya_core.engine.limits import check_length
from laya_core.engine.stream import ADMITTED, GenerationStream, deliver
from laya_core.logs import start_named
from laya_core.models.tokenizer import Tokenizer
from laya_core.replica.client import (
    EngineState,
    EngineUnavailableError,
    ReplicaInfo,
    UnsupportedParameterError,
)
from laya_core.replica.engine_backend import EngineBackendClient
from laya_core.structured.spec import ConstraintSpec
from laya_core.types import FinishReason, SamplingParams, Timing, TokenEvent, Usage

GENERATOR = "generator"  # the layer of the generator's passes (/metrics)
_IDLE_WAIT_S = 0.2  # how long an idle thread waits for work before it looks at its halt flag


@attrs.define(eq=False)
class _Request:
    """A running request as the generator's thread keeps it."""

    rid: int
    prompt: tuple[int, ...]
    params: SamplingParams
    stops: frozenset[int]  # end-of-generation tokens (unless ignore_eos) and stop_token_ids
    stream: GenerationStream
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer
    waited: float  # seconds waiting for a place (max_num_seqs)
    submitted: float = attrs.field(factory=time.perf_counter)
    started: float | None = None  # the generator gave it pages
    first: float | None = None
    last: float = 0.0
    gaps: list[float] = attrs.field(factory=list)
    num_tokens: int = 0


class ExlClient(EngineBackendClient):
    """One replica of an ``exl2`` or ``exl3`` model; see the module docstring."""

    def __init__(self, config: ModelConfig, replica_id: int, backend_name: str,
                 runtime_cls: type[Runtime], settings: Callable[[], Settings]) -> None:
        super().__init__(config, replica_id)
        self.backend_name = backend_name
        self._runtime_cls = runtime_cls
        self._settings = settings
        self._tokenizer: FolderTokenizer | None = None
        self._loaded: tuple[Runtime, Settings] | None = None
        self._eog: frozenset[int] = frozenset()
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._halt = threading.Event()
        self._runner: threading.Thread | None = None
        # The generator thread's own: requests it runs, and events not yet handed over.
        self._live: dict[int, _Request] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Any, TokenEvent]]] = {}

    # -- lifecycle (the replica's thread) -----------------------------------------------------

    def load(self) -> ReplicaInfo:
        self._stop_runner()  # a load after the replica went down starts afresh
        settings = self._settings()
        where = f"{self.config.path} on {', '.join(settings.placement.devices)}"
        tokenizer, info = load_tokenizer(self.config.path, where)
        runtime = self._runtime_cls.load(settings)
        self._tokenizer, self._eog = tokenizer, info.eog_token_ids
        self._loaded = runtime, settings
        self._halt.clear()
        self._runner = threading.Thread(target=self._run, args=(runtime,), daemon=True,
                                        name=f"laya-{self.backend_name}-{self.model}-"
                                             f"{self.replica_id}")
        start_named(self._runner, "laya-exl2")
        replica = self.replica_info(info, settings.max_seq_len, self.backend_name)
        return attrs.evolve(replica, block_size=PAGE_TOKENS)  # the generator's pages

    def check(self) -> None:
        if self._runner is None or not self._runner.is_alive():
            raise RuntimeError(f"the {self.backend_name} generator's thread has stopped")

    def close(self) -> None:
        self._stop_runner()

    def _stop_runner(self) -> None:
        if self._runner is not None:
            self._halt.set()
            self._runner.join()
            self._runner = None
        if self._loaded is not None:
            self._loaded[0].close()
            self._loaded = None

    def runtime(self) -> dict[str, Any]:
        if self._loaded is None:
            return {}
        runtime, s = self._loaded
        return {"library": runtime.version, "devices": list(s.placement.devices),
                "layers": list(s.placement.layers), "kv_cache_dtype": s.kv_cache_dtype,
                "cache_tokens": s.pool_tokens, "chunk_tokens": s.chunk_tokens,
                "restarts": self.restarts}

    def tokenizer(self) -> Tokenizer:
        self.info()  # raises until loaded
        assert self._tokenizer is not None
        return self._tokenizer

    # -- requests (the event loop) -------------------------------------------------------------

    def _refuse_what_cannot_run(self, params: SamplingParams,
                                constraint: ConstraintSpec | None) -> None:
        said = f"the {self.backend_name} backend of {self.model!r}"
        if constraint is not None:
            raise UnsupportedParameterError(
                constraint.param, f"{said} does not constrain its output (structured output, "
                f"guided decoding, tool calls); send the request without this "
                f"{constraint.kind} constraint, or serve the model with a backend that "
                "constrains it (llamacpp, torch)")
        if params.logprobs is not None:
            raise UnsupportedParameterError("logprobs", f"{said} returns no log-probabilities")
        if params.prompt_logprobs is not None:
            raise UnsupportedParameterError("prompt_logprobs",
                                            f"{said} returns no log-probabilities")

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        if self._state is not EngineState.READY or self._tokenizer is None:
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} is "
                                         f"{self._state.value}")
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        self._refuse_what_cannot_run(params, constraint)
        check_length(len(prompt_token_ids), params.max_tokens, self.info().max_seq_len)
        waited = await self.wait_for_room()  # the manifest's max_num_seqs and max_queue
        rid = next(self._ids)
        stream = self.new_stream(rid, len(prompt_token_ids))
        eog = frozenset() if params.ignore_eos else self._eog
        request = _Request(rid, tuple(prompt_token_ids), params,
                           eog | frozenset(params.stop_token_ids), stream,
                           asyncio.get_running_loop(),
                           IncrementalDetokenizer(self._tokenizer.token_bytes, params.stop,
                                                  params.shown_tokens), waited)
        self._inbox.put(("submit", request))
        return stream

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))

    # -- the generator's thread ---------------------------------------------------------------

    def _run(self, runtime: Runtime) -> None:
        try:
            while not self._halt.is_set():
                self._take_inbox(runtime, wait=not runtime.has_work())
                if runtime.has_work():
                    start = time.perf_counter()
                    outputs = runtime.iterate()
                    self.add_layer_seconds(GENERATOR, time.perf_counter() - start)
                    for out in outputs:
                        if out.rid in self._live:
                            self._feed(runtime, self._live[out.rid], out)
                self._deliver()
            why, lost = f"{self.model} replica {self.replica_id} stopped", False
        except Exception as e:  # noqa: BLE001 - the generator failed: so does the replica
            why, lost = f"the {self.backend_name} generator failed: {type(e).__name__}: {e}", True
            self.mark_down(why)
        self._end_all(why, lost)

    def _take_inbox(self, runtime: Runtime, wait: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, what = item
            if kind == "submit":
                self._start(runtime, what)
            elif what in self._live:  # a cancel
                self._end(self._live[what], FinishReason.CANCELLED, "",
                          cached=runtime.cancel(what))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _start(self, runtime: Runtime, request: _Request) -> None:
        self._live[request.rid] = request
        try:
            runtime.enqueue(request.rid, request.prompt, request.params, sorted(request.stops))
        except Exception as e:  # noqa: BLE001 - this job alone: the library refused it
            self._end(request, FinishReason.ERROR, "",
                      error=f"the {self.backend_name} generator refused the request: "
                            f"{type(e).__name__}: {e}")

    def _feed(self, runtime: Runtime, request: _Request, out: Output) -> None:
        """Hand on what one iteration produced for ``request``."""
        if out.started or out.token_ids:
            self._admit(request)
        for token in out.token_ids:
            finish, text = self._add_token(request, token)
            if finish is None:
                self._send(request, TokenEvent(text, (token,)))
                continue
            # Ended here: by the generator too where it said so, else its job is cancelled.
            cached = out.cached_tokens if out.end else runtime.cancel(request.rid)
            self._end(request, finish, text, (token,), cached)
            return
        if out.end is not None:
            reason = FinishReason.LENGTH if out.end in LENGTH_REASONS else FinishReason.STOP
            self._end(request, reason, request.detokenizer.flush(), cached=out.cached_tokens)

    def _add_token(self, request: _Request, token: int) -> tuple[FinishReason | None, str]:
        """Count a token; its text, and whether it ends the request (as the core's engine
        decides, laya_core/engine/progress.py)."""
        now = time.perf_counter()
        if request.first is None:
            request.first = now
        else:
            request.gaps.append(now - request.last)
        request.last = now
        request.num_tokens += 1
        if token in request.stops:
            return FinishReason.STOP, request.detokenizer.flush()
        text, stopped = request.detokenizer.add(token)
        if stopped:
            return FinishReason.STOP, text
        if request.num_tokens >= request.params.max_tokens:
            return FinishReason.LENGTH, text + request.detokenizer.flush()
        return None, text

    def _admit(self, request: _Request) -> None:
        if request.started is None:
            request.started = time.perf_counter()
            self._send(request, ADMITTED)

    def _end(self, request: _Request, reason: FinishReason, text: str,
             token_ids: tuple[int, ...] = (), cached: int = 0, error: str | None = None,
             lost: bool = False) -> None:
        del self._live[request.rid]
        now = time.perf_counter()
        started = request.started or now
        first = request.first or now
        timing = Timing(queue_s=request.waited + started - request.submitted,
                        prefill_s=first - started, decode_s=(request.last or now) - first,
                        token_gaps_s=tuple(request.gaps))
        usage = Usage(len(request.prompt), request.num_tokens, min(cached, len(request.prompt)))
        self._send(request, TokenEvent(text, token_ids, reason, error, timing, usage=usage,
                                       replica_lost=lost))
        self.count_finished(reason, request.num_tokens)

    def _end_all(self, why: str, lost: bool) -> None:
        """End what runs and what waits in the inbox: the generator is gone."""
        while True:
            try:
                kind, what = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._live[what.rid] = what
        for request in list(self._live.values()):
            self._end(request, FinishReason.ERROR, request.detokenizer.flush(), error=why,
                      lost=lost)
        self._deliver()

    def _send(self, request: _Request, event: TokenEvent) -> None:
        self._outbox.setdefault(request.loop, []).append((request.stream.queue, event))

    def _deliver(self) -> None:
        """Hand the iteration's events to their event loops, one call each."""
        for loop, events in self._outbox.items():
            try:
                loop.call_soon_threadsafe(deliver, events)
            except RuntimeError:  # that loop has closed: nobody reads those streams
                pass
        self._outbox = {}
