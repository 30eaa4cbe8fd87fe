"""The PyTorch backend: Llama-family models on the core's paged KV pool.

A step is one forward pass over every item (``model.py``); the logits of the rows that
sample or score are computed, sampled on tensors (``sampling.py``) and scored. ``torch`` is
imported in ``load_weights`` only, so a manifest that does not choose this backend never
pays for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from laya_backend_torch import memory, options
from laya_core.backend import (
    Backend,
    MemoryProfile,
    ModelConfig,
    ModelInfo,
    StepItem,
    StepResult,
)
from laya_core.engine.embed_jobs import EmbedPlan, embed_whole, pooled_rows
from laya_core.engine.threads import ThreadGovernor
from laya_core.kv.dtypes import FLOAT_KV_DTYPES
from laya_core.memory.devices import Gpus
from laya_core.models.files import ModelShape, read_shape
from laya_core.models.pooling import DEFAULT_POOLING
from laya_core.types import Sample, SamplingParams

log = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Options (``[models.options]``, spec/manifest.md): ``device`` ("cpu" or "cuda"),
    ``dtype`` ("auto", "float32", "bfloat16", "float16"), ``quantize`` ("auto": a quantized
    file's own precision on a CPU, "none", "int8": weight-only, per output channel, or
    "int4": the layers' matrices in groups of 32, a Q4_1 file's own 4-bit weights),
    ``n_threads`` ("auto" or a number), ``compile`` (false, or true for torch.compile),
    ``deterministic``."""

    name = "torch"
    kv_layout = "paged"
    kv_cache_dtypes = FLOAT_KV_DTYPES  # torch's float32, float16 and bfloat16
    supports_prompt_logprobs = True
    supports_speculative = True
    # torch's CPU int4 kernel takes rows in tiles of four, each reading every weight: a
    # decode took 12.4 ms, a check of 4 rows 18.1, of 5 rows 26.9 (Intel Xeon with AMX,
    # 2 threads). So the default prompt lookup drafts 3 tokens here.
    auto_draft_tokens = 3
    # A second instance runs the draft model, its pool's blocks handed out by the engine's
    # draft model (laya_core/engine/draft_model.py).
    supports_draft_model = True
    supports_lora = True  # per row: one step mixes adapters (lora.py)
    supports_embeddings = True
    embeds_in_chunks = True  # embed_step: chunks of inputs, several inputs a pass
    option_names = frozenset(options.OPTIONS)
    threads_option = "n_threads"
    # A prompt's last chunk of two tokens or more, as before backends declared it: a
    # one-row batch runs other matrix kernels than a longer chunk (not measured here).
    min_last_prompt_chunk = 2

    @classmethod
    def check_option(cls, name: str, value: object) -> str | None:
        return options.check(name, value)

    @classmethod
    def check_devices(cls, config: ModelConfig, gpus: Gpus) -> dict[str, str]:
        device = memory.planned_device(config)
        if device == "cpu" or device in gpus.budgets:
            return {}
        has = f"it has {', '.join(gpus.names)}" if gpus.budgets else \
            "it has none (no NVIDIA driver found)" if gpus.local else "it has none"
        return {"options.device": f'"{config.options["device"]}": {gpus.machine} has no such '
                f'CUDA GPU ({has}); use "cpu"{gpus.elsewhere}'}

    @classmethod
    def check_options(cls, opts: dict[str, Any]) -> dict[str, str]:
        return options.check_together(opts)

    @classmethod
    def check_model_path(cls, path: str) -> str | None:
        return options.check_path(path)

    @classmethod
    def memory_profile(cls, config: ModelConfig, shape: ModelShape) -> MemoryProfile:
        return memory.memory_profile(config, shape)

    _model: Any = None
    _tokenizer: Any = None
    _lone_checks = False  # whether _checks names a lone sequence's check (load_weights)

    def load_weights(self) -> ModelInfo:
        import torch

        from laya_backend_torch.checkpoint import open_checkpoint
        from laya_backend_torch.lora import Adapters
        from laya_backend_torch.model import LlamaModel
        from laya_backend_torch.quant import ALIKE_ROWS
        from laya_backend_torch.tokenizer import load_tokenizer

        self._torch = torch
        checkpoint = open_checkpoint(self.config.path)
        cfg = checkpoint.config
        chosen = options.choose(self.config.options, checkpoint.quantization)
        # The load on one thread, the steps on chosen.threads. The load is about 3,300 small
        # tensor operations (the int4 packing, the head's int8), each ending at an OpenMP
        # barrier that waits for every thread of the team: while another process, or
        # another replica loading at once, holds a core, each barrier waits out a scheduler
        # slice with the other thread spinning. SmolLM2 on a 2-vCPU Xeon beside two busy
        # processes: 28 s and 13 s of CPU on two threads, 14 s and 3.5 s of CPU on one;
        # on idle cores one thread is no slower (2.9 s against 3.2).
        torch.set_num_threads(1)
        self._governor = ThreadGovernor(chosen.threads) if chosen.auto_threads else None
        self._device = torch.device(chosen.device)
        self._dtype = getattr(torch, chosen.dtype)
        self._tokenizer = tok = load_tokenizer(self.config.path)
        max_positions = max(self.config.max_seq_len or 4096, 16)
        with torch.inference_mode():
            tensors = memory.as_kept(checkpoint.tensors(as_stored=chosen.quantize == "int4"),
                                     self._dtype,
                                     chosen.quantize != "none",
                                     cfg.tie_word_embeddings)
            self._model = LlamaModel(cfg, tensors, self._dtype, self._device,
                                     quantize=chosen.quantize,
                                     max_positions=max_positions,
                                     rope_freqs=getattr(checkpoint, "rope_freqs", None),
                                     attention_dtype=torch.float64 if chosen.deterministic
                                     else torch.float32,
                                     chunk_rows=ALIKE_ROWS if chosen.deterministic else 0)
        memory.release_freed_heap()  # the load's temporaries, so the plan's weights are RSS
        torch.set_num_threads(chosen.threads)
        self._model.set_threads(chosen.threads)
        self._vocab = cfg.vocab_size
        self._forward = self._model.forward
        if chosen.compile:
            self._forward = torch.compile(self._model.forward, dynamic=True)
        self._samplers: dict[int, Any] = {}
        self._adapters = Adapters(cfg, self._device, chosen.deterministic)
        for name, folder in self.config.lora.items():
            self._adapters.load(name, str(folder))
        self.pooling = read_shape(self.config.path).pooling or DEFAULT_POOLING
        # A row's products are the same bits in a product of any number of rows
        # (quant.two_rows); float32's kernels, CUDA's and torch.compile's code can change
        # with the row count.
        row_exact = chosen.device == "cpu" and not chosen.compile \
            and (chosen.dtype != "float32" or chosen.quantize != "none")
        self._lone_checks = row_exact and not chosen.deterministic  # (_checks)
        self._runtime: dict[str, Any] = {
            "device": chosen.device, "dtype": chosen.dtype, "dtype_reason": chosen.reason,
            "quantize": chosen.quantize, "quantize_reason": chosen.quantize_reason,
            "n_threads": chosen.threads, "compile": chosen.compile,
            # Whether a step's small operations run in laya_torch_kernels (model.py's
            # _forward_native) or as eager PyTorch operations.
            "kernels": self._kernels_report(),
            # Who multiplies the 4-bit layer matrices: laya_torch_kernels (quant.Q4Linear),
            # naming its code for this CPU, or torch's int4 kernel; absent without int4.
            **({"int4_products": self._model.int4_products()} if chosen.quantize == "int4"
               else {}),
            "torch": torch.__version__, "cpu_capability": options.cpu_capability(),
            "checkpoint": checkpoint.description,
            # Whether a sequence's logits are the same bits in any batch and chunking: the
            # 16-bit and integer products give that (quant.two_rows), float32's change with
            # the row count, and attention needs float64 (deterministic, model._attend).
            "deterministic": chosen.deterministic,
            "embedding_pooling": self.pooling,
            "batch_invariant": row_exact and chosen.deterministic,
            # Whether drafts change no output: a check's rows get a lone decode's bits
            # (batch.build_batch's checks, _checks: every check on the kernels, a lone
            # sequence's on PyTorch's attention), so a kept draft is what decoding one token
            # at a time gives.
            "exact_drafts": row_exact,
            "lora": {name: {"path": str(w_path), "bytes": self._adapters.loaded[name].nbytes}
                     for name, w_path in self.config.lora.items()},
        }
        info = tok.info
        return ModelInfo(
            n_ctx_train=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
            eog_token_ids=info.eog_token_ids, chat_template=info.chat_template,
            bos_token=info.bos_token, eos_token=info.eos_token, add_bos=info.add_bos,
            description=f"{cfg.architecture} {cfg.num_layers} layers, {chosen.dtype}"
                        f"{'' if chosen.quantize == 'none' else ' ' + chosen.quantize}"
                        f" on {chosen.device}",
            special_tokens=tok.special_tokens)

    def _kernels_report(self) -> str:
        """/ready's ``kernels``: whether laya_torch_kernels runs the steps, else why not
        (the model's ``kernels_off``, or this replica's KV cache)."""
        if self._model.kernels_off:
            return f"off: {self._model.kernels_off}"
        if self.config.kv_cache_dtype == "f32":
            return "off: they take a 16-bit KV cache (kv_cache_dtype f16 or bf16)"
        head = ", the int8 output head too" if self._model.native_head else ""
        return f"laya_torch_kernels (steps without LoRA rows{head})"

    def load_adapter(self, name: str, path: str) -> None:
        weights = self._adapters.load(name, path)
        self._runtime["lora"][name] = {"path": path, "bytes": weights.nbytes}

    def unload_adapter(self, name: str) -> None:
        self._adapters.unload(name)
        self._runtime["lora"].pop(name, None)

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        kv_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[
            self.config.kv_cache_dtype]
        self._block_size = self.block_size
        self._model.allocate_kv(num_tokens // self.block_size * self.block_size,
                                getattr(self._torch, kv_dtype))
        # The embedding scratch: one input's KV of its own, so an embedding never takes
        # blocks from the KV manager or writes a running sequence's (memory.py, embeddings).
        if not self.config.embeddings:
            return
        pool = self._model.kv_pool
        cells = memory.embed_cells(self.config)
        self._embed_pool = self._torch.zeros((pool.shape[0], cells, *pool.shape[2:]),
                                             dtype=pool.dtype, device=pool.device)
        # embed_step: each embedding sequence's slots in the scratch and its pooled sum.
        self._embed_free = list(range(cells - 1, -1, -1))
        self._embed_tables: dict[int, list[int]] = {}
        self._embed_sums: dict[int, Any] = {}
        # A step's tokens at most, so as many one-token inputs as one pass can hold.
        self.max_embed_inputs = self.config.max_step_tokens

    def embed(self, token_ids: Sequence[int]) -> Any:
        """The final norm's hidden states of ``token_ids``, pooled (``self.pooling``): the
        input prefilled in chunks of max_step_tokens, as a prompt is, into the scratch."""
        return embed_whole(self.embed_step, token_ids, self.config.max_step_tokens)

    def embed_step(self, plan: EmbedPlan) -> list[Any]:
        """``plan``'s chunks (Backend.embed_step) in one forward pass over the scratch, each
        as a prompt chunk of its own input. The scratch is handed out a slot per token
        (a block table with blocks of one), so the inputs begun at once, at most
        max_seq_len tokens together, always fit it."""
        from laya_backend_torch.batch import build_batch

        torch = self._torch
        for seq in plan.dropped:
            self._drop_embedding(seq)
        items, rows, owners = [], [], []  # owners: the chunk of each pooled row
        first = 0
        for i, c in enumerate(plan.chunks):
            table = self._embed_tables.setdefault(c.seq, [])
            table += [self._embed_free.pop() for _ in c.tokens]
            wanted = pooled_rows(self.pooling, c.start, len(c.tokens), c.last)
            rows += [first + j for j in wanted]
            owners += [i] * len(wanted)
            items.append((list(c.tokens), c.start, table))
            first += len(c.tokens)
        try:
            batch = build_batch(items, rows, 1, native=self._model.native).to(self._device)
            with torch.inference_mode():
                hidden = self._model.forward(batch, kv_pool=self._embed_pool, hidden=True)
            sums = torch.zeros(len(plan.chunks), hidden.shape[1], dtype=torch.float64)
            sums.index_add_(0, torch.tensor(owners, dtype=torch.long), hidden.double().cpu())
        except BaseException:
            for c in plan.chunks:
                self._drop_embedding(c.seq)
            raise
        out: list[Any] = []
        for i, c in enumerate(plan.chunks):
            pooled = self._embed_sums.pop(c.seq, 0) + sums[i]
            if not c.last:
                self._embed_sums[c.seq] = pooled
                out.append(None)
                continue
            self._drop_embedding(c.seq)
            n = c.start + len(c.tokens)
            out.append((pooled / n if self.pooling == "mean" else pooled).numpy())
        return out

    def _drop_embedding(self, seq: int) -> None:
        """Forget embedding sequence ``seq``: its scratch slots go back, its sum goes."""
        self._embed_free += self._embed_tables.pop(seq, [])
        self._embed_sums.pop(seq, None)

    def load_tokenizer(self) -> Any:
        """The tokenizer alone (the file's vocabulary; no torch import), for a front end
        whose replica runs in a worker process."""
        from laya_backend_torch.tokenizer import load_tokenizer

        return load_tokenizer(self.config.path)

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("the model is not loaded")
        return self._tokenizer

    def describe(self) -> dict[str, Any]:
        runtime = dict(getattr(self, "_runtime", {}))
        governor = getattr(self, "_governor", None)
        if governor is not None:
            runtime.update(n_threads=governor.threads, n_threads_mode="auto",
                           n_threads_max=governor.max_threads,
                           n_threads_drops=governor.num_drops)
        return runtime

    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        from laya_backend_torch.sampling import SequenceSampler

        if params.lora is not None:
            self._adapters.start(seq_id, params.lora)
        self._samplers[seq_id] = SequenceSampler(params, self._vocab, self._device)

    def free_sequence(self, seq_id: int) -> None:
        self._samplers.pop(seq_id, None)
        self._adapters.free(seq_id)

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        from laya_backend_torch.batch import build_batch
        from laya_backend_torch.sampling import sample_rows

        torch = self._torch
        rows: list[int] = []  # batch rows whose logits are computed
        sampled: list[int] = []  # items that sample, in order
        sample_at: list[int] = []  # their rows among the computed logits
        scored: list[tuple[int, int]] = []  # (item, index into rows of its first scored row)
        first = 0
        for i, item in enumerate(items):
            if item.score_targets:
                scored.append((i, len(rows)))
                rows += range(first, first + len(item.score_targets))
            if item.sample:  # the last row, and the rows of a draft before it
                sampled.append(i)
                sample_at.append(len(rows))
                rows += range(first + len(item.tokens) - 1 - len(item.draft),
                              first + len(item.tokens))
            first += len(item.tokens)
        lora_rows = self._adapters.rows([it.seq_id for it in items],
                                        [len(it.tokens) for it in items])
        native = self._model.native and not lora_rows
        batch = build_batch(((list(it.tokens), it.start_pos, list(it.block_table))
                             for it in items), rows, self._block_size,
                            self._checks(items, native), native).to(self._device)
        # PyTorch's own threads only where its operations do a step's work (model.py's
        # products_native): a prompt chunk's attention, or the products.
        alone = native and not batch.attention.chunks and self._model.products_native
        if alone:
            torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                logits = self._run(batch, lora_rows)
                scores = {i: self._score(logits[at:at + len(items[i].score_targets)],
                                         items[i]) for i, at in scored}
                picks: list[Sample | str] = []
                if sampled:
                    index = torch.tensor(sample_at, dtype=torch.long, device=logits.device)
                    picks = sample_rows(logits[index], [self._samplers[items[i].seq_id]
                                                        for i in sampled],
                                        [items[i].allowed_tokens for i in sampled])
                out = [StepResult(None, scores.get(i, ())) for i in range(len(items))]
                for i, at, pick in zip(sampled, sample_at, picks, strict=True):
                    if isinstance(pick, str):
                        out[i] = StepResult(None, scores.get(i, ()), pick)
                        continue
                    sampler = self._samplers[items[i].seq_id]
                    sampler.accept(pick.token_id)
                    out[i] = StepResult(pick, scores.get(i, ()),
                                        accepted=self._verify(logits, at, items[i], pick, sampler))
        finally:
            if alone:
                torch.set_num_threads(self._model.threads)
        return out

    def _checks(self, items: Sequence[StepItem], native: bool) -> set[int]:
        """The items whose rows attend as lone decodes (model.build_batch): a draft's check,
        whose kept rows then have a lone decode's bits (``exact_drafts``).

        On the kernels (``native``) every check: each of their queries attends on its own
        anyway, a decode's as a check's. On PyTorch's attention only a check whose sequence
        is the step's only one decoding, which without the draft would have decoded alone:
        beside other decoding sequences it would have attended in their padded call, whose
        bits row by row is no nearer to than one call, which costs less (eight checks of 4
        rows: 86-88 ms a step against 98-104, Intel Xeon with AMX). Float64 attention
        (``deterministic``) gives a row the same bits in any call already."""
        drafted = [i for i, item in enumerate(items) if item.draft]
        if native:
            return set(drafted)
        if not self._lone_checks:
            return set()
        decoding = [i for i, item in enumerate(items)
                    if item.sample and len(item.tokens) == 1 + len(item.draft)]
        return set(decoding) if len(decoding) == 1 and decoding == drafted else set()

    def _verify(self, logits: Any, at: int, item: StepItem, pick: Sample,
                sampler: Any) -> tuple[Sample, ...]:
        """The samples of a draft's rows (``logits[at + 1 ..]``), row after row while each
        row's token is the draft's next one, each under its mask (``draft_allowed``); the
        sequence's sampler counts each."""
        from laya_backend_torch.sampling import sample_rows

        accepted: list[Sample] = []
        for j, (token, mask) in enumerate(zip(item.draft, item.draft_masks, strict=True)):
            if pick.token_id != token:
                break
            (sample,) = sample_rows(logits[at + j + 1:at + j + 2], [sampler], [mask])
            if isinstance(sample, str):  # the mask allows nothing: the draft ends here
                break
            sampler.accept(sample.token_id)
            accepted.append(pick := sample)
        return tuple(accepted)

    def _run(self, batch: Any, lora_rows: Any = ()) -> Any:
        """The forward pass; with ``threads = "auto"`` timed for the thread governor, which
        gives threads up while other processes hold the cores (laya_core/engine/threads.py)."""
        if self._governor is None:
            return self._forward(batch, lora=lora_rows)
        wall, busy = time.perf_counter(), time.thread_time()
        logits = self._forward(batch, lora=lora_rows)
        changed = self._governor.record(time.perf_counter() - wall, time.thread_time() - busy)
        if changed is not None:
            self._torch.set_num_threads(changed)
            self._model.set_threads(changed)
            log.info("%s: %d of %d torch threads (steps had their thread on a CPU %.0f%% of "
                     "the time)", self.config.name, changed, self._governor.max_threads,
                     100 * (self._governor.last_share or 0))
        return logits

    def _score(self, logits: Any, item: StepItem) -> tuple[Sample, ...]:
        """Each prompt target's log-probability, rank and the ``score_top`` likeliest, from
        the model's raw distribution."""
        torch = self._torch
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(list(item.score_targets), dtype=torch.long, device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        ranks = (logp > chosen[:, None]).sum(dim=1) + 1
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
        if item.score_top:
            values, ids = logp.topk(item.score_top, dim=1)
            tops = [tuple(zip(r.tolist(), v.tolist(), strict=True))
                    for r, v in zip(ids, values, strict=True)]
        return tuple(Sample(int(t), float(lp), top, rank=int(r)) for t, lp, top, r
                     in zip(targets.tolist(), chosen.tolist(), tops, ranks.tolist(),
                            strict=True))

    def close(self) -> None:
        self._model = None
        self._samplers = {}
        closing = getattr(self._tokenizer, "close", None)
        if closing is not None:
            closing()
