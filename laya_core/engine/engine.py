"""The engine of one model replica: a thread looping schedule -> backend.step -> publish.

Model compute never runs on the asyncio loop. Requests enter through a thread-safe inbox;
events leave in one ``loop.call_soon_threadsafe`` per step and event loop, which puts each
into its request's asyncio queue: the loop wakes once per step, not once per token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import attrs

from laya_core.backend import Backend, ModelConfig, ModelInfo
from laya_core.engine import draft_model
from laya_core.engine.adapters import AdapterJob, AdapterJobs
from laya_core.engine.allowed_tokens import NO_TOKEN_ALLOWED, TokenConstraint
from laya_core.engine.detokenizer import IncrementalDetokenizer
from laya_core.engine.draft_model import DraftModel, ModelDrafter
from laya_core.engine.embed_jobs import EmbedCancel, Embeddings, EmbedJob
from laya_core.engine.embed_queue import EmbedQueue
from laya_core.engine.embedding import embed_next, queue_embed
from laya_core.engine.handover import Outbox
from laya_core.engine.layer_clock import (
    BACKEND,
    DELIVER,
    DETOKENIZE,
    DRAFT,
    LOOP,
    PREFILL,
    SCHEDULE,
    LayerClock,
    now_ns,
)
from laya_core.engine.limits import check_length
from laya_core.engine.loading import build_scheduler
from laya_core.engine.progress import Live
from laya_core.engine.request import Request
from laya_core.engine.scheduler import Scheduler
from laya_core.engine.speculative import NgramDrafter, SpeculativeStats
from laya_core.engine.state import EngineState, EngineUnavailableError, QueueFullError
from laya_core.engine.stream import ADMITTED, Courier, EventSink, GenerationStream
from laya_core.kv.policies import KVCache, KVOp
from laya_core.logs import start_named
from laya_core.memory.ledger import default_kv_bytes_per_token, sizes_for
from laya_core.models.tokenizer import Tokenizer
from laya_core.types import (
    FinishReason,
    Sample,
    SamplingParams,
    SpeculativeConfig,
    TokenEvent,
    Usage,
)

log = logging.getLogger(__name__)
_IDLE_POLL_S = 0.5
# The ends counted in Engine.finished; a REJECTED one is a refusal, counted in rejections.
_COUNTED_FINISHES = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED,
                     FinishReason.ERROR)


class Engine:
    """Drives one backend instance. Create, ``start()``, then ``submit`` from the asyncio loop."""

    _ids = itertools.count()

    def __init__(self, config: ModelConfig, backend: Backend,
                 scheduler_cls: type[Scheduler], cache_cls: type[KVCache],
                 replica_id: int = 0,
                 on_loaded: Callable[[Engine], None] | None = None) -> None:
        self.config = config
        self._on_loaded = on_loaded  # a check of the loaded model; raising fails the load
        self.backend = backend
        self.replica_id = replica_id
        self._scheduler_cls = scheduler_cls
        self._cache_cls = cache_cls
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None  # the backend's, once loaded; any thread
        self.max_seq_len = 0
        self.sizes: ModelConfig | None = None  # the config with its pool sizes decided
        self.scheduler: Scheduler | None = None
        # What the engine thread is asked: a request to add, a sequence id to cancel, an
        # embed request or its cancel, or None to stop.
        self._inbox: queue.SimpleQueue[
            Live | int | EmbedJob | EmbedCancel | AdapterJob | None] = \
            queue.SimpleQueue()
        # Embed requests, fed after each step in what it left of the step's token budget
        # (laya_core/engine/embed_queue.py); made at load, when the backend's limits are known.
        self._embeds: EmbedQueue | None = None
        self._adapter_jobs = AdapterJobs()
        self._live: dict[int, Live] = {}
        # Events since the last hand-over, by the courier that carries them; see _flush.
        self._outbox = Outbox(config.stream_interval_ms / 1000)
        self._lock = threading.Lock()  # guards the two counters below
        self._num_queued = 0  # submitted, not yet admitted or finished
        self.rejections: dict[str, int] = {"queue_full": 0, "queue_timeout": 0}
        # Prefix cache, counted as vLLM does: prompt tokens looked up at admission (queried)
        # and those whose KV was found (hit, not prefilled); plus the sequences that hit.
        self.prefix_queried_tokens = 0
        self.prefix_tokens_reused = 0
        self.prefix_hits = 0
        self.generated_tokens = 0  # tokens sampled for all sequences, for a live tokens/s
        self.embedded_tokens = 0  # input tokens fed to the backend's embedding passes
        self.embed_passes = 0  # the backend's embed_step calls
        self.speculative = SpeculativeStats()  # drafts checked and tokens kept
        self._draft: DraftModel | None = None  # speculative method "draft": its model
        # The speculative decoding its requests get, once loaded: the config's, but the
        # default's (``auto``) only where the backend's rows are exact.
        self._speculative: SpeculativeConfig | None = None
        # Where the engine thread's time goes, layer by layer (laya_core/engine/layer_clock.py);
        # a worker process adds its step messages' time.
        self.clock = LayerClock()
        # Sequences ended, by reason (refused ones are in ``rejections``); written by the
        # engine thread only.
        self.finished: dict[FinishReason, int] = dict.fromkeys(_COUNTED_FINISHES, 0)
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"laya-engine-{config.name}-{replica_id}", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        start_named(self._thread, "laya-engine")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading ended (ready or failed); returns whether it is ready."""
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the asyncio side --------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`RequestTooLongError` when the request can never fit one sequence."""
        check_length(num_prompt_tokens, max_tokens, self.max_seq_len)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               loop: Courier | None = None,
               constraint: TokenConstraint | None = None,
               sink: EventSink | None = None) -> GenerationStream:
        """Queue a request; call from the event loop that will read the stream.
        ``constraint``: what the sequence may sample at each step (``Request.constraint``);
        it is called on the engine thread. ``sink``: where the events go instead of the
        returned stream's queue (a worker process forwards them; ``put_nowait`` is called
        through ``loop``, all of a step's events in one callback). ``loop``: the running
        event loop when None, or a :class:`~laya_core.engine.stream.Courier`."""
        if self.state is not EngineState.READY:
            raise EngineUnavailableError(
                f"{self.config.name} replica {self.replica_id} is {self.state.value}")
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        if params.prompt_logprobs is not None and not self.backend.supports_prompt_logprobs:
            raise ValueError(f"the {self.backend.name} backend cannot compute prompt "
                             "log-probabilities")
        self.check_request(len(prompt_token_ids), params.max_tokens)
        self._take_place()
        courier: Courier = loop or asyncio.get_running_loop()
        assert self.tokenizer is not None
        seq = Request(next(self._ids), list(prompt_token_ids), params, constraint=constraint,
                      min_last_chunk=self.backend.min_last_prompt_chunk)
        spec = self._speculative
        if spec is not None and spec.auto and params.lora is not None:
            spec = None  # an adapter's several-row products are not a decode's (auto: exact)
        # Drafts are checked row by row with the sequence's own sampler, each row under its
        # constraint's mask where it has one: a constraint that cannot look ahead of the
        # tokens kept (a plain callable) leaves its sequence decoding without drafts.
        if spec is not None and params.speculative and seq.drafts_under_constraint \
                and self.backend.supports_speculative:
            seq.drafter = NgramDrafter(spec, seq.prompt_token_ids) if self._draft is None \
                else ModelDrafter(self._draft, spec)
        stream = GenerationStream(seq.seq_id, seq.num_prompt_tokens, self.cancel)
        detok = IncrementalDetokenizer(self.tokenizer.token_bytes, params.stop,
                                       params.shown_tokens)
        self._inbox.put(Live(seq, courier, sink or stream.queue, detok))
        return stream

    def embed(self, inputs: list[list[int]],
              loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[Embeddings]:
        """Queue an embed request (token ids per input); call from the event loop that
        awaits the future. It waits in the same queue as generation requests, and runs on
        the engine thread after each step, in what the step left of its token budget.
        Cancelling the future (its caller went away) drops what is left of it
        (laya_core/engine/embedding.py)."""
        return queue_embed(self, inputs, loop)

    def _take_place(self) -> None:
        """Count one more request waiting, or raise :class:`QueueFullError`."""
        with self._lock:
            # max_queue = 0: nothing waits; a request runs at the next step or is refused
            # (_reject), so no more than a batch may be on its way in.
            limit = self.config.max_queue or (
                self.scheduler.config.max_num_seqs if self.scheduler else 1)
            if self._num_queued >= limit:
                self.rejections["queue_full"] += 1
                raise QueueFullError(
                    f"{self._num_queued} requests already wait for room on "
                    f"{self.config.name} replica {self.replica_id}; retry later"
                    if self.config.max_queue else
                    f"no room is free now on {self.config.name} replica {self.replica_id} "
                    "and max_queue is 0; retry later")
            self._num_queued += 1

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(seq_id)

    def adapter(self, op: str, name: str, path: str | None = None) -> Future[None]:
        """Load (``op`` "load", from the adapter at ``path``) or unload a LoRA adapter on
        the engine thread; an unload waits for the requests using it
        (laya_core/engine/adapters.py). Any thread may call this."""
        job = AdapterJob(op, name, path)
        if self.state is not EngineState.READY:
            job.done.set_exception(EngineUnavailableError(
                f"{self.config.name} replica {self.replica_id} is {self.state.value}"))
        else:
            self._inbox.put(job)
        return job.done

    def live_requests(self) -> list[Live]:
        """The requests this engine holds, waiting or running (engine thread)."""
        return list(self._live.values())

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) if self.scheduler else 0

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running (in the inbox or the scheduler's queue)."""
        return self._num_queued

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens reserved by live sequences (cached prefixes not counted)."""
        kv = self.scheduler.kv if self.scheduler else None
        return kv.num_used_blocks * kv.block_size if kv else 0

    @property
    def kv_cached_tokens(self) -> int:
        """KV tokens of finished sequences kept for prefix reuse; freed whenever needed."""
        kv = self.scheduler.kv if self.scheduler else None
        return kv.num_cached_blocks * kv.block_size if kv else 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.kv.capacity_tokens if self.scheduler else 0

    def _dequeued(self) -> None:
        with self._lock:
            self._num_queued -= 1

    def runtime(self) -> dict[str, object]:
        """The backend's own account of how it runs (``Backend.describe``), once loaded."""
        if self.info is None:
            return {}
        try:
            described = dict(self.backend.describe())
        except Exception as e:  # noqa: BLE001 - a report must not break /ready
            return {"describe_error": f"{type(e).__name__}: {e}"}
        if self.state is not EngineState.LOADING:  # the drafts its requests get (_load)
            spec = self._speculative
            described["speculative"] = "off" if spec is None else spec.method + (
                f" (default: drafts of up to {spec.num_speculative_tokens} tokens, which "
                "change no output)" if spec.auto else "")
        return described

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool reserved by live sequences."""
        capacity = self.kv_capacity_tokens
        return self.kv_used_tokens / capacity if capacity else 0.0

    # -- the engine thread -------------------------------------------------------------------

    def _load(self) -> None:
        self.info = self.backend.load_weights()
        self.tokenizer = self.backend.tokenizer()
        # A planned config has every size decided; a hand-made one is decided here by the
        # same computation as `laya plan`'s.
        n_ctx = self.info.n_ctx_train
        self.sizes = sizes = sizes_for(self.config, n_ctx, default_kv_bytes_per_token(
            self.config, type(self.backend), n_ctx))
        assert sizes.max_seq_len
        self.max_seq_len = sizes.max_seq_len
        self.scheduler = build_scheduler(self.config, sizes, self.backend,
                                         self._scheduler_cls, self._cache_cls)
        self._embeds = EmbedQueue(self.max_seq_len, self.backend.max_embed_inputs,
                                  self.backend.embeds_in_chunks, self._dequeued)
        spec = self.config.speculative
        if spec is not None and spec.auto:
            runtime = self.runtime()
            if runtime.get("batch_invariant") or runtime.get("exact_drafts"):
                # No longer than the plan counted (the default's length), and no longer
                # than the backend's kernels check cheaply.
                spec = attrs.evolve(spec, num_speculative_tokens=min(
                    spec.num_speculative_tokens, self.backend.auto_draft_tokens))
            else:
                spec = None  # drafts could change the output: the default leaves them off
        self._speculative = spec
        if spec is not None and spec.method == "draft":  # laya_core/engine/draft_model.py
            tokens = self.tokenizer
            self._draft = draft_model.load(sizes, type(self.backend), [
                tokens.token_bytes(i) for i in range(tokens.vocab_size)])
        if self._on_loaded is not None:
            self._on_loaded(self)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - any load failure is reported, not raised
            log.exception("loading %s failed", self.config.name)
            self.error = f"{type(e).__name__}: {e}"
            self.state = EngineState.FAILED
            self._ready.set()
            return
        self.state = EngineState.READY
        self._ready.set()
        try:
            assert self.scheduler is not None and self._embeds is not None
            while True:
                idle = not (self.scheduler.has_work or self._embeds.has_work)
                start = now_ns()
                if not self._drain_inbox(block=idle):
                    break
                if not idle:  # the wait for work is no layer's time
                    self.clock.add(LOOP, start)
                self._step()
                embed_next(self)  # laya_core/engine/embedding.py
                self._adapter_jobs.check(self)  # laya_core/engine/adapters.py
        except Exception as e:  # noqa: BLE001 - a plugin's fault fails this replica only
            self._fail(e)
        finally:
            if self.state is not EngineState.FAILED:
                self.state = EngineState.STOPPED
                for live in list(self._live.values()):
                    self._finish(live, FinishReason.CANCELLED, "")
            if self._embeds is not None:
                self._embeds.fail_all(EngineUnavailableError(self.error or "the replica stopped"))
            self._adapter_jobs.fail_all(EngineUnavailableError(self.error or
                                                               "the replica stopped"))
            self._flush()
            if self._draft is not None:
                self._draft.close()
            self.backend.close()

    def _fail(self, e: Exception) -> None:
        """A step could not be planned or run past its own error handling (a scheduler or
        cache policy plugin raised): end this replica's requests with the reason, and
        answer every later one with it until the replica is stopped."""
        log.exception("%s replica %d stopped", self.config.name, self.replica_id)
        self.error = (f"a step failed outside the backend (scheduler {self.config.scheduler!r}"
                      f", cache policy {self.config.cache_policy!r}): {type(e).__name__}: {e}")
        self.state = EngineState.FAILED
        lives = list(self._live.values())
        self._live.clear()
        if self._embeds is not None:
            self._embeds.fail_all(EngineUnavailableError(self.error))
        while True:
            for live in lives:
                seq = live.seq
                if not live.started:
                    self._dequeued()
                self._emit(live, TokenEvent("", (), FinishReason.ERROR, self.error, usage=Usage(
                    seq.num_prompt_tokens, len(seq.output_token_ids))))
            self._flush()
            payload = self._inbox.get()  # what was submitted before the state said so
            if payload is None:
                return
            if isinstance(payload, EmbedJob):
                payload.fail(EngineUnavailableError(self.error))
            if isinstance(payload, AdapterJob):
                payload.done.set_exception(EngineUnavailableError(self.error))
            lives = [payload] if isinstance(payload, Live) else []

    def _emit(self, live: Live, event: TokenEvent) -> None:
        self._outbox.add(live, event)

    def _flush(self) -> None:
        """Hand the events gathered so far to their event loops, one wake-up per loop."""
        start = now_ns()
        if self._outbox.hand_over():
            self.clock.add(DELIVER, start)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and cancels; returns False once asked to stop."""
        while True:
            try:
                payload = self._inbox.get(timeout=_IDLE_POLL_S) if block \
                    else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if payload is None:
                return False
            if isinstance(payload, Live):
                self._add(payload)
            elif isinstance(payload, EmbedJob):
                assert self._embeds is not None
                self._embeds.add(payload)
            elif isinstance(payload, EmbedCancel):
                assert self._embeds is not None
                self._embeds.cancel(payload.job)
            elif isinstance(payload, AdapterJob):
                self._adapter_jobs.add(self, payload)
            elif (live := self._live.get(payload)) is not None:
                self._finish(live, FinishReason.CANCELLED, "")

    def _add(self, live: Live) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.add(live.seq)
        except ValueError as e:
            self._dequeued()
            self._emit(live, TokenEvent("", (), FinishReason.ERROR, str(e),
                                        usage=Usage(live.seq.num_prompt_tokens, 0)))
            return
        self._live[live.seq.seq_id] = live

    def _started(self, live: Live) -> None:
        """``live``'s sequence is known to the backend now: count its prefix-cache lookup."""
        seq = live.seq
        live.started = True
        self._dequeued()
        self._emit(live, ADMITTED)
        assert self.scheduler is not None
        # Every admitted prompt is looked up, except one whose log-probabilities are wanted.
        if self.scheduler.kv.prefix_caching and not seq.scores_prompt:
            self.prefix_queried_tokens += seq.num_prompt_tokens
        if seq.num_cached_tokens:
            self.prefix_hits += 1
            self.prefix_tokens_reused += seq.num_cached_tokens

    def forget_adapter_kv(self, name: str) -> None:
        """The cache policy forgets the KV computed under LoRA adapter ``name``, and the
        backend drops it now (an unload follows; laya_core/engine/adapters.py)."""
        assert self.scheduler is not None
        self.scheduler.kv.forget_adapter(name)
        self._apply(self.scheduler.kv.take_ops())

    def _apply(self, ops: tuple[KVOp, ...]) -> None:
        for op in ops:
            try:
                op.apply(self.backend)
            except Exception as e:  # noqa: BLE001 - fail the sequences it concerns, go on
                self._op_failed(op, e)

    def _op_failed(self, op: KVOp, e: Exception) -> None:
        """The backend could not apply ``op``: the cache policy forgets what it was to make,
        and the running sequences whose KV it was to prepare fail; the others go on."""
        log.exception("the backend could not apply %r", op)
        assert self.scheduler is not None
        kv = self.scheduler.kv
        handles = set(kv.op_failed(op))
        why = f"the backend could not prepare this request's KV cache: {type(e).__name__}: {e}"
        for seq in [s for s in self.scheduler.running if kv.handle(s) in handles]:
            self._finish(self._live[seq.seq_id], FinishReason.ERROR, "", why)

    def _reject(self, seqs: list[Request], reason: str, why: str) -> None:
        """Refuse waiting requests: those that waited past queue_timeout_s (503), or with
        max_queue = 0 those the step could not admit (429)."""
        for seq in seqs:
            with self._lock:
                self.rejections[reason] += 1
            self._finish(self._live[seq.seq_id], FinishReason.REJECTED, "", why)

    def _step(self) -> None:
        assert self.scheduler is not None
        start = now_ns()
        if self.scheduler.waiting:
            deadline = time.perf_counter() - self.config.queue_timeout_s
            self._reject([s for s in self.scheduler.waiting if s.arrival_time < deadline],
                         "queue_timeout", f"waited {self.config.queue_timeout_s:g} s for "
                         "room in the KV cache")
        if self._draft is not None:  # the draft model's compute, a layer of its own
            start = self.clock.add(SCHEDULE, start)
            self._draft.prepare(self.scheduler.running)
            start = self.clock.add(DRAFT, start)
        plan = self.scheduler.schedule()
        if self.config.max_queue == 0 and self.scheduler.waiting:
            self._reject(list(self.scheduler.waiting), "queue_full",
                         "no room is free now and max_queue is 0")
        self._apply(plan.ops)
        for seq in self.scheduler.running:
            if not (live := self._live[seq.seq_id]).started:
                self._started(live)
        # A chunk's sequence is gone when an op it needed failed (``_op_failed``).
        chunks = [c for c in plan.chunks if c.seq.seq_id in self._live]
        if not chunks:
            self.clock.add(SCHEDULE, start)
            self._flush()
            return
        items = [c.item() for c in chunks]
        layer = PREFILL if any(c.seq.is_prefilling for c in chunks) else BACKEND
        self.clock.add(SCHEDULE, start)
        # The previous step's tokens and this step's admissions go out just before the model
        # runs: the model call releases the GIL, so the event loop formats and sends them
        # while it runs instead of holding the GIL between two steps (measured at concurrency
        # 1: 0.70 ms between two decodes when sent after the step, against 0.30 without HTTP).
        # Before a decode step they may instead wait for its tokens (engine/handover.py).
        if layer is PREFILL or not self._outbox.may_wait():
            self._flush()
        start = now_ns()
        try:
            sampled = self.backend.step(items)
        except Exception as e:  # noqa: BLE001 - fail the step's sequences, keep serving
            log.exception("backend step failed")
            for c in chunks:
                self._finish(self._live[c.seq.seq_id], FinishReason.ERROR, "",
                             f"{type(e).__name__}: {e}")
            self._flush()  # now, not after the idle poll when nothing else runs
            return
        stepped = start
        start = self.clock.add(layer, start)
        if layer is BACKEND:
            self._outbox.decode_s = (start - stepped) / 1e9
        for c, result in zip(chunks, sampled, strict=True):
            seq = c.seq
            seq.num_computed += len(c.tokens)
            live = self._live[seq.seq_id]
            live.prompt_logprobs += result.scores
            if result.error == NO_TOKEN_ALLOWED:  # its constraint cannot go on: cut short
                self._finish(live, FinishReason.LENGTH, "", result.error)
            elif result.error is not None:  # this sequence alone could not go on
                self._finish(live, FinishReason.ERROR, "", result.error)
            elif result.sample is not None:
                if c.draft:
                    self._drafted(seq, len(c.draft), len(result.accepted))
                if self._on_token(live, result.sample):
                    # Each kept draft token is the sample before it, whose KV it computed.
                    for sample in result.accepted:
                        seq.num_computed += 1
                        if not self._on_token(live, sample):
                            break
            if seq.seq_id in self._live:  # (a finished one's cache has had its say)
                self.scheduler.kv.computed(seq)
        self.clock.add(DETOKENIZE, start)
        if not self.scheduler.has_work:
            self._flush()  # no next step to carry them

    def _on_token(self, live: Live, sample: Sample) -> bool:
        """Hand on a sampled token; False when it ended its sequence."""
        assert self.info is not None
        self.generated_tokens += 1
        out = live.add_token(sample, self.info.eog_token_ids, self.max_seq_len)
        token = (sample.token_id,)
        if out.finish is None:
            self._emit(live, TokenEvent(out.text, token, samples=out.samples,
                                        prompt_logprobs=out.prompt_logprobs))
            return True
        self._finish(live, out.finish, out.text, token_ids=token, samples=out.samples,
                     prompt_logprobs=out.prompt_logprobs)
        return False

    def _drafted(self, seq: Request, num_draft: int, num_accepted: int) -> None:
        """Count a checked draft, for the sequence, its drafter and the replica."""
        assert seq.drafter is not None
        seq.drafter.accepted(num_draft, num_accepted)
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted
        stats = self.speculative
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted

    def _finish(self, live: Live, reason: FinishReason, text: str, error: str | None = None,
                token_ids: tuple[int, ...] = (), samples: tuple[Sample, ...] = (),
                prompt_logprobs: tuple[Sample, ...] = ()) -> None:
        seq = live.seq
        assert self.scheduler is not None
        retain = reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.scheduler.finish(seq, retain=retain and live.started)
        self._apply(self.scheduler.kv.take_ops())
        if seq.drafter is not None:
            seq.drafter.close()
        if not live.started:
            self._dequeued()
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        if reason in self.finished:
            self.finished[reason] += 1
        del self._live[seq.seq_id]
        timing = live.timing()
        usage = Usage(seq.num_prompt_tokens, len(seq.output_token_ids),
                      seq.num_cached_tokens if live.started else 0)
        self._emit(live, TokenEvent(text, token_ids, reason, error, timing, samples=samples,
                                    prompt_logprobs=prompt_logprobs, usage=usage))

