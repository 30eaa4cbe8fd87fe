"""The memory ledger: weights + KV pool + overheads per replica, against a budget.

Made before anything loads, from file headers only. ``laya plan`` prints it; ``laya serve``
refuses to start when it does not fit and says which settings would.
"""

from __future__ import annotations

from typing import Any

import attrs

from laya_core.backend import Backend, MemoryProfile, ModelConfig
from laya_core.memory.budget import Budget
from laya_core.memory.devices import HOST, NO_GPUS, Gpus, device_index
from laya_core.models.files import ModelShape

# The Python interpreter, Laya, the HTTP stack and the backend libraries, once per process.
# Measured: 54 MiB after importing everything with llama_cpp; the rest is thread stacks and
# allocator slack under load.
# Plus the chat-template sandbox, a child process in the same cgroup, at its address-space
# cap (laya_core/serving/template_sandbox.py; about 22 MiB resident when idle).
# Plus the Responses API's store of responses (laya_core/http/response_store.py): at most
# 16 MiB of their JSON text and 1024 entries of 256 B.
RESPONSE_STORE_BYTES = 16 * 2**20 + 1024 * 256
RUNTIME_OVERHEAD_BYTES = 96 * 2**20 + 64 * 2**20 + RESPONSE_STORE_BYTES
# A replica in a worker process of its own (laya_core/replica/worker.py): Python, Laya and the
# backend's library again. Measured (AMD EPYC, CPython 3.11): 41 MiB after importing the
# worker and its core modules, 54 MiB with llama_cpp's library; the rest is the worker's
# threads' stacks and allocator slack.
WORKER_PROCESS_BYTES = 64 * 2**20
# The front end keeps each replica's tokenizer (Backend.load_tokenizer): llama.cpp's
# vocabulary-only load of 49,152 tokens measured 17 MiB.
FRONT_TOKENIZER_BYTES_PER_TOKEN = 400
# Structured output (laya_core/structured/), measured with the embedded model's 49,152
# tokens: llguidance's index of the vocabulary took 25 MiB (AMD EPYC), once in the replica
# and once in its compile child; the child's interpreter and llguidance 25 MiB more (Intel
# Xeon: 50 MiB resident once started). The cache's bytes and one compile's memory are the
# compiler's own bounds (structured/compiler.py CACHE_BYTES, sandbox.py memory_bytes).
GRAMMAR_VOCAB_BYTES_PER_TOKEN = 540
GRAMMAR_CHILD_BYTES = 26 * 2**20
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 4
# More sequences by default where the KV pool they need stays small: 8 full-length sequences
# whose pool is at most ROOMY_KV_POOL_BYTES (the embedded model's: 720 MiB in f16), and only
# where the whole plan still fits (make_plan). Eight concurrent requests then start at once
# rather than half of them queueing: c=8 ran 1.17x llama-server's defaults with TTFT p50 151
# ms, against 1.07x and 2331 ms with 4 (Intel Xeon, docs/benchmarks.md). A 7B model's pool
# of 8 x 4096 tokens is 4 GiB (GQA, f16) to 16 GiB (none), so it keeps 4: the seed's lesson.
ROOMY_MAX_NUM_SEQS = 8
ROOMY_KV_POOL_BYTES = 2 * 2**30
# Prompt positions whose logits one step may ask for (prompt log-probabilities). Each costs
# vocab x 4 bytes of logits (192 KiB for a 49,152-token vocabulary: 24 MiB for 128), so the
# scheduler cuts such prompts into chunks of at most this many and the backend plans it.
MAX_SCORED_TOKENS_PER_STEP = 128


def scored_tokens_per_step(max_step_tokens: int) -> int:
    """How many prompt positions with logits one step of this size may hold."""
    return min(max_step_tokens, MAX_SCORED_TOKENS_PER_STEP)


def sampled_rows_per_step(config: ModelConfig) -> int:
    """How many rows of logits one step may sample: one per running sequence, and with
    speculative decoding one more per draft token, within the step's token budget; only
    steps of at most ``disable_by_batch_size`` sequences draft."""
    seqs = config.max_num_seqs or 1  # (a plan's config has it decided)
    spec = config.speculative
    if spec is None:
        return seqs
    drafting = seqs if spec.disable_by_batch_size is None else \
        min(seqs, spec.disable_by_batch_size)
    return min(config.max_step_tokens,
               max(seqs, drafting * (1 + spec.num_speculative_tokens)))


@attrs.frozen
class ReplicaLedger:
    model: str
    replica: int
    config: ModelConfig  # with max_seq_len, max_num_seqs and kv_cache_tokens decided
    profile: MemoryProfile
    cpu_threads: int | None = None  # the backend's Backend.cpu_threads; None: not known

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len or 0

    @property
    def pool_tokens(self) -> int:
        return self.config.kv_cache_tokens or 0

    @property
    def kv_bytes_per_seq(self) -> int:
        return self.profile.kv_bytes_per_token * self.max_seq_len

    @property
    def kv_pool_bytes(self) -> int:
        return self.profile.kv_bytes_per_token * self.pool_tokens

    @property
    def overhead_bytes(self) -> int:
        return sum(o.bytes for o in self.profile.overheads)

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs this replica places memory on."""
        p = self.profile
        used = {*p.weights_on, *p.kv_bytes_per_token_on,
                *(o.device for o in p.overheads if o.device != HOST)}
        return tuple(sorted(used, key=device_index))

    def weights_on(self, device: str) -> int:
        p = self.profile
        return (p.weights_bytes - sum(p.weights_on.values()) if device == HOST
                else p.weights_on.get(device, 0))

    def kv_pool_on(self, device: str) -> int:
        p = self.profile
        per_token = (p.kv_bytes_per_token - sum(p.kv_bytes_per_token_on.values())
                     if device == HOST else p.kv_bytes_per_token_on.get(device, 0))
        return per_token * self.pool_tokens

    def bytes_on(self, device: str) -> int:
        """What this replica holds on ``device`` ("cpu": the host's RAM)."""
        return (self.weights_on(device) + self.kv_pool_on(device)
                + sum(o.bytes for o in self.profile.overheads if o.device == device))

    @property
    def total_bytes(self) -> int:
        """What this replica holds in the host's RAM (its GPUs' share: ``bytes_on``)."""
        return self.bytes_on(HOST)

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences of full max_seq_len the pool holds at once."""
        return self.pool_tokens // self.max_seq_len if self.max_seq_len else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "replica": self.replica, "backend": self.config.backend,
            "max_seq_len": self.max_seq_len, "max_num_seqs": self.config.max_num_seqs,
            "kv_cache_tokens": self.pool_tokens, "kv_dtype": self.profile.kv_dtype,
            "weights_bytes": self.profile.weights_bytes,
            "weights_source": self.profile.weights_source,
            "kv_bytes_per_token": self.profile.kv_bytes_per_token,
            "kv_bytes_per_seq": self.kv_bytes_per_seq, "kv_pool_bytes": self.kv_pool_bytes,
            "overhead_bytes": self.overhead_bytes,
            "overheads": [attrs.asdict(o) for o in self.profile.overheads],
            "total_bytes": self.total_bytes, "max_concurrent_seqs": self.max_concurrent_seqs,
            "gpu_bytes": {d: self.bytes_on(d) for d in self.gpus},
        }


@attrs.frozen
class Plan:
    replicas: tuple[ReplicaLedger, ...]
    runtime_bytes: int
    budget: Budget
    suggestions: tuple[str, ...] = ()
    processes: bool = False  # each replica in a worker process (its ledger says so)
    gpus: Gpus = NO_GPUS  # the GPUs planned for, with their budgets

    def model_bytes(self, model: str) -> int:
        """What all replicas of ``model`` hold, as planned."""
        return sum(r.total_bytes for r in self.replicas if r.model == model)

    def model_gpu_bytes(self, model: str) -> dict[str, int]:
        """What all replicas of ``model`` hold on each GPU, as planned."""
        mine = [r for r in self.replicas if r.model == model]
        return {d: sum(r.bytes_on(d) for r in mine) for d in {d for r in mine for d in r.gpus}}

    @property
    def gpu_room(self) -> dict[str, int]:
        """By GPU, what its budget leaves beside the pinned replicas' share of it: the room
        of the models loaded on demand."""
        return {d: b.bytes - sum(r.bytes_on(d) for r in self.pinned)
                for d, b in self.gpus.budgets.items()}

    @property
    def pinned(self) -> tuple[ReplicaLedger, ...]:
        """The replicas loaded with the server (``load = "always"``)."""
        return tuple(r for r in self.replicas if not r.config.on_demand)

    @property
    def largest_on_demand(self) -> str | None:
        """The on-demand model that needs the most room; None when there is none."""
        sizes = {r.model: self.model_bytes(r.model) for r in self.replicas
                 if r.config.on_demand}
        return max(sizes, key=lambda m: (sizes[m], m)) if sizes else None

    @property
    def peak(self) -> tuple[ReplicaLedger, ...]:
        """The replicas the total counts: the pinned ones and the largest on-demand model's.
        Each on-demand model must fit beside the pinned ones; two of them are loaded together
        only while the budget has room (laya_core/serving/residency.py)."""
        largest = self.largest_on_demand
        return tuple(r for r in self.replicas if not r.config.on_demand or r.model == largest)

    @property
    def shared_bytes_counted_once(self) -> int:
        """What the replica ledgers count more than once of the overheads their process
        shares (``Overhead.shared``): every replica's ledger holds the line, since each
        alone would need it, and the total takes each shared key's largest once."""
        return self._shared_counted_once(HOST)

    def _shared_counted_once(self, device: str) -> int:
        by_key: dict[str, list[int]] = {}
        for r in self.peak:
            for o in r.profile.overheads:
                if o.shared is not None and o.device == device:
                    by_key.setdefault(o.shared, []).append(o.bytes)
        return sum(sum(sizes) - max(sizes) for sizes in by_key.values())

    @property
    def total_bytes(self) -> int:
        """The most the deployment holds at once: the runtime, the pinned replicas and the
        largest on-demand model."""
        return (self.runtime_bytes + sum(r.total_bytes for r in self.peak)
                - self.shared_bytes_counted_once)

    @property
    def gpus_used(self) -> tuple[str, ...]:
        """The GPUs the replicas place memory on (those the plan has and any it lacks)."""
        return tuple(sorted({d for r in self.replicas for d in r.gpus}, key=device_index))

    def gpu_bytes(self, device: str) -> int:
        """The most ``device`` holds at once: the pinned replicas' share of it and the
        largest on-demand model's; a shared line (a process's CUDA context) once."""
        return (sum(r.bytes_on(device) for r in self.peak)
                - self._shared_counted_once(device))

    @property
    def gpus_over(self) -> tuple[str, ...]:
        """The GPUs whose share is over their budget (one the plan lacks has none)."""
        return tuple(d for d in self.gpus_used
                     if self.gpu_bytes(d) > self.gpus.budget_bytes(d))

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget.bytes and not self.gpus_over

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits, "budget_bytes": self.budget.bytes,
            "budget_source": self.budget.source, "headroom_bytes": self.budget.headroom_bytes,
            "runtime_bytes": self.runtime_bytes, "worker_processes": self.processes,
            "shared_bytes_counted_once": self.shared_bytes_counted_once,
            "total_bytes": self.total_bytes,
            "pinned_bytes": sum(r.total_bytes for r in self.pinned),
            "largest_on_demand": self.largest_on_demand,
            "replicas": [r.to_json() for r in self.replicas],
            "gpus": {d: {"budget_bytes": self.gpus.budget_bytes(d), "total_bytes":
                         self.gpu_bytes(d), "budget_source": b.source if (
                             b := self.gpus.budgets.get(d)) else "no such GPU"}
                     for d in sorted({*self.gpus.budgets, *self.gpus_used},
                                     key=device_index)},
            "suggestions": list(self.suggestions),
        }


def decide_sizes(config: ModelConfig, shape: ModelShape,
                 backend_cls: type[Backend] | None = None) -> ModelConfig:
    """Fill in max_seq_len (smaller of 4096 and the model's own) and the KV pool size; with
    ``backend_cls``, the number of sequences by default_num_seqs, else by the fixed default."""
    per_token = 0 if backend_cls is None else default_kv_bytes_per_token(
        config, backend_cls, shape.n_ctx_train, shape)
    return sizes_for(config, shape.n_ctx_train, per_token)


def default_kv_bytes_per_token(config: ModelConfig, backend_cls: type[Backend],
                               n_ctx_train: int, shape: ModelShape | None = None) -> int:
    """The KV bytes per token that default_num_seqs weighs, where ``config`` leaves the
    number of sequences to it: the backend's price for the model (``memory_profile``); 0
    where the config sets it, or the model's shape cannot be read (then the fixed default)."""
    if config.max_num_seqs is not None or config.kv_cache_tokens is not None:
        return 0
    try:
        if shape is None:
            shape = backend_cls.model_shape(config.path)
        profile = backend_cls.memory_profile(sizes_for(config, n_ctx_train), shape)
    except Exception:  # noqa: BLE001 - an unknown price keeps the fixed default
        return 0
    return profile.kv_bytes_per_token


def default_num_seqs(max_seq_len: int, kv_bytes_per_token: int) -> int:
    """The sequences a model runs when its manifest entry sets neither ``max_num_seqs`` nor
    ``kv_cache_tokens``: ROOMY_MAX_NUM_SEQS where their pool stays within
    ROOMY_KV_POOL_BYTES (``kv_bytes_per_token`` 0: not known, as where no plan was made),
    else DEFAULT_MAX_NUM_SEQS."""
    pool = ROOMY_MAX_NUM_SEQS * max_seq_len * kv_bytes_per_token
    return ROOMY_MAX_NUM_SEQS if 0 < pool <= ROOMY_KV_POOL_BYTES else DEFAULT_MAX_NUM_SEQS


def sizes_for(config: ModelConfig, n_ctx_train: int, kv_bytes_per_token: int = 0) -> ModelConfig:
    """``config`` with max_seq_len, max_num_seqs, kv_cache_tokens and max_step_tokens decided.

    The one computation of pool sizes: ``laya plan`` runs it on the file's header, the engine
    on the loaded model, and a config it has already decided comes back unchanged. With
    ``kv_cache_tokens`` and no explicit ``max_num_seqs``, the number of sequences is how
    many full-length ones the pool holds (at least 1); with neither, ``default_num_seqs``.
    """
    max_seq_len = config.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, n_ctx_train)
    if config.kv_cache_tokens is not None:
        pool = config.kv_cache_tokens
        if pool < max_seq_len:
            raise ValueError(f"kv_cache_tokens ({pool}) is smaller than max_seq_len "
                             f"({max_seq_len}): one full-length sequence would not fit")
        seqs = config.max_num_seqs or min(256, max(1, pool // max_seq_len))
    else:
        seqs = config.max_num_seqs or default_num_seqs(max_seq_len, kv_bytes_per_token)
        pool = max_seq_len * seqs
    step = max(config.max_step_tokens, seqs)
    return attrs.evolve(config, max_seq_len=max_seq_len, max_num_seqs=seqs, kv_cache_tokens=pool,
                        max_step_tokens=step)
