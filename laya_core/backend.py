"""The backend contract: load a model, run one batched step, free a sequence.

A backend is step-based. The engine calls :meth:`Backend.step` with one :class:`StepItem` per
scheduled sequence (prompt chunks of new sequences and one token for each decoding one), and
the backend runs them together. A backend declares its KV layout (``kv_layout``): on the
paged layout each item carries the block table of its sequence in the core's KV pool; a
streams-layout backend keeps a KV stream per sequence and ships the cache policy that
places them (``register_cache_policies``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from laya_core.backend_types import (
    MemoryProfile,
    ModelConfig,
    ModelInfo,
    Overhead,
    StepItem,
    StepResult,
)
from laya_core.kv.dtypes import FLOAT_KV_DTYPES, KVDtypes
from laya_core.kv.hashing import BLOCK_SIZE
from laya_core.models.tokenizer import Tokenizer
from laya_core.types import SamplingParams

if TYPE_CHECKING:
    from laya_core.engine.embed_jobs import EmbedPlan
    from laya_core.memory.devices import Gpus
    from laya_core.models.files import ModelShape

# The data the contract's methods take and return live in backend_types.py; they are
# named here too, so a plugin imports the whole contract from this module.
__all__ = ["Backend", "MemoryProfile", "ModelConfig", "ModelInfo", "Overhead", "StepItem",
           "StepResult"]


class Backend(abc.ABC):
    """A model runtime. Subclasses are registered through ``register_backends``.

    Construction must be cheap and must not import the runtime's library; ``load`` does the
    heavy work. All methods except ``__init__`` and ``describe`` are called from the replica's
    engine thread. Tokenizing is not a backend method: the :class:`Tokenizer` that
    ``tokenizer()`` returns is called from any thread.
    """

    name: ClassVar[str]
    # "step": the core schedules and keeps the KV cache, and the backend runs one batched
    # forward pass per step (the methods below). "engine": the backend owns its scheduling
    # and cache (a serving library, a remote server) and serves each replica through an
    # EngineClient of its own (laya_core.replica.engine_backend.EngineBackend).
    kind: ClassVar[str] = "step"
    # The KV cache element types this backend can store, each with its price: name ->
    # (elements per block, bytes per block), laya_core/kv/dtypes.py. The manifest's
    # kv_cache_dtype must name one; the memory plan prices it with this table.
    kv_cache_dtypes: ClassVar[KVDtypes] = {"f16": FLOAT_KV_DTYPES["f16"]}
    # How the KV pool is laid out: "paged" (the core's KV manager hands out blocks and each
    # StepItem carries its block table) or "streams" (a KV stream per sequence, kept by the
    # backend's own cache policy).
    kv_layout: ClassVar[str] = "streams"
    # Tokens per KV block: the core's KV manager hands out blocks of this many on the paged
    # layout, and prefix reuse, the router's prefix hashes and /live count in them. A
    # library with pages of its own size (exllamav2's 256) declares it here.
    block_size: ClassVar[int] = BLOCK_SIZE
    # The fewest prompt tokens a prompt's last chunk holds (unless the prompt is shorter),
    # and so the fewest a prefix reuse leaves to compute. 1: the token the first output is
    # sampled from. A library whose one-token batch takes other kernel paths than a longer
    # chunk (llama.cpp) says 2, so a reused prefix answers as the first computation did.
    min_last_prompt_chunk: ClassVar[int] = 1
    # Whether step() scores ``StepItem.score_targets`` (prompt log-probabilities); requests
    # asking for them are refused on backends that do not.
    supports_prompt_logprobs: ClassVar[bool] = False
    # Whether step() verifies drafts (``StepItem.draft``): speculative decoding.
    supports_speculative: ClassVar[bool] = False
    # The longest draft of the default prompt lookup (types.AUTO_SPECULATIVE) here: a check
    # of that many tokens and one more should cost the matrix kernels little beyond a
    # decode (a manifest's own ``num_speculative_tokens`` is kept as written).
    auto_draft_tokens: ClassVar[int] = 4
    # Whether a second instance of the backend can run a draft model beside the model
    # (speculative method "draft", laya_core/engine/draft_model.py), with no cache policy:
    # on the streams layout its KV is a stream per slot the engine hands out (and trims with
    # ``trim_sequence``); on the paged layout the engine hands out the pool's blocks itself.
    supports_draft_model: ClassVar[bool] = False
    # Whether the backend applies LoRA adapters (``ModelConfig.lora``) per sequence
    # (``SamplingParams.lora``): it loads each one with its weights and counts it in
    # ``memory_profile``.
    supports_lora: ClassVar[bool] = False
    # The adapter format ``read_adapter`` reads: "peft" (a folder) or "gguf" (llama.cpp's
    # one file); the conformance kit writes its test adapters in it.
    lora_format: ClassVar[str] = "peft"
    # Whether the replica compiles structured output's constraints (response_format, tools,
    # guided decoding) with laya_core.structured: a step-level backend does (the core masks
    # its sampling), and the memory plan counts the grammars' memory; an engine-level
    # backend that refuses them, or passes them on to an engine that enforces them itself,
    # says False, and nothing is counted for them.
    supports_constraints: ClassVar[bool] = True
    # Whether ``embed`` computes embeddings (``/v1/embeddings``); requests for a model whose
    # backend does not are refused with a 400 naming the model.
    supports_embeddings: ClassVar[bool] = False
    # Whether ``embed_step`` takes an input in chunks over several calls; one that only
    # implements ``embed`` gets whole inputs, one per call.
    embeds_in_chunks: ClassVar[bool] = False
    # How many inputs ``embed_step`` may hold at once (its embedding sequences); set by
    # ``allocate_kv`` where the memory it allocates decides it.
    max_embed_inputs: int = 1
    # The keys ``[models.options]`` may hold for this backend; anything else is a manifest error.
    option_names: ClassVar[frozenset[str]] = frozenset()
    # The ``[models.options]`` key that sets a replica's compute threads, which ``laya
    # serve --threads`` (``LAYA_THREADS``) writes; None: the backend has no such option.
    threads_option: ClassVar[str | None] = None
    # The ``[models.options]`` key whose whole number puts that many of the model's layers
    # on GPUs (llama.cpp's ``n_gpu_layers``); its "auto" leaves it to the memory plan, which
    # takes the most that fit every device's budget, up to what ``place`` allows. None: the
    # backend places its memory by other options (torch's ``device``).
    gpu_layers_option: ClassVar[str | None] = None
    # Which backend a ``[[models]]`` entry without ``backend`` gets, among the installed ones
    # that take its model (``check_model_path`` passes): the highest preference, ties by
    # name. A backend that is the natural runtime of a model format sets it above 0.
    default_preference: ClassVar[int] = 0

    @classmethod
    def cpu_threads(cls, config: ModelConfig) -> int | None:
        """The CPU threads one replica of ``config`` computes with, where known before it
        loads (a Ray actor asks for them as ``num_cpus``); None: not known, one is asked.
        The default reads the ``threads_option`` option when it is a whole number."""
        value = config.options.get(cls.threads_option) if cls.threads_option else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return None

    # Whether a model's path is a local file or folder Laya reads (its header plans the
    # memory). False: the path names what the backend reaches by other means (a URL, a
    # remote model's name); ``laya check`` looks for no file, and ``laya plan`` takes the
    # shape from ``model_shape``.
    needs_model_file: ClassVar[bool] = True

    @classmethod
    def check_model_path(cls, path: str) -> str | None:
        """A problem with the model path for this backend (said to the user), or None."""
        return None

    @classmethod
    def check_model_metadata(cls, metadata: Mapping[str, Any],
                             tensor_dims: Mapping[str, Sequence[int]]) -> str | None:
        """A problem with a GGUF file's metadata (and its tensors' dimensions, by name) that
        this backend's library would fail on, said to the user, or None. Called once the
        core's own checks passed (``laya_core/models/checks.py``: counts present, whole and
        consistent), by ``laya check`` and ``laya plan`` (``model_shape``); a library that
        aborts the process on bad metadata (llama.cpp) checks its limits here and again
        before it loads."""
        return None

    @classmethod
    def model_shape(cls, path: str) -> ModelShape:
        """The model's shape for the memory plan, from headers alone (nothing loaded). The
        default reads the local GGUF file or Hugging Face folder; a backend without a local
        file (``needs_model_file = False``) says what it knows, with ``weights_bytes`` the
        memory this machine holds for the weights (0 when they live elsewhere)."""
        from laya_core.models.files import read_shape

        return read_shape(path, cls.check_model_metadata)

    @classmethod
    def read_adapter(cls, path: str, base: ModelShape | None) -> Any:
        """The LoRA adapter at ``path`` (a ``laya_core.models.lora.Adapter``), checked from
        its headers against the model's shape ``base`` (None: not checked); raises
        ``AdapterError`` naming the field or tensor. The default reads a PEFT folder; a
        backend that loads another format reads it here (llama.cpp: a GGUF file)."""
        from laya_core.models.lora import read_adapter

        return read_adapter(path, base)

    @classmethod
    def place(cls, config: ModelConfig, shape: ModelShape,
              gpus: Gpus) -> tuple[ModelConfig, int]:
        """``config`` with the device options it leaves to the plan decided for ``gpus``
        (llama.cpp: how the layers split among several), but ``gpu_layers_option``; and the
        most layers that option may put on them (0: none, as on a machine without a GPU or
        where the library was built without GPU support)."""
        return config, 0

    @classmethod
    def check_devices(cls, config: ModelConfig, gpus: Gpus) -> dict[str, str]:
        """Problems with what ``config`` asks of the GPUs planned for (one they lack, a
        library built without GPU support), by the key they are said under
        ("options.device", "backend"). ``laya check``, ``laya plan`` and ``laya serve``
        call it for the machine they run on, and ``laya plan --gpus`` for the machine it
        describes: ``gpus.local`` tells which, and only this machine's GPUs have a build
        to check (a CUDA library, a driver). ``gpus.machine`` names the machine in an
        error; ``gpus.elsewhere`` is the hint to plan for another one."""
        return {}

    @classmethod
    def check_option(cls, name: str, value: object) -> str | None:
        """A problem with the value of ``[models.options]`` key ``name`` (one of
        ``option_names``), said to the user after the key's path, or None."""
        return None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> dict[str, str]:
        """Problems of values that are fine alone but not together (a dtype the chosen
        device lacks), by the option they are said under; called once every key passed
        ``check_option``."""
        return {}

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    @classmethod
    def memory_profile(cls, config: ModelConfig, shape: ModelShape) -> MemoryProfile:
        """What one replica costs, from the model's shape alone (nothing loaded).

        ``config`` has its sizes decided. The default counts weights and KV exactly and a
        generic compute buffer (one step's logits and activations, float32); backends that
        know their allocator better override this.
        """
        from laya_core.kv.dtypes import kv_bytes_per_token

        step = config.max_step_tokens
        compute = step * (shape.vocab_size + 4 * shape.hidden_size) * 4
        return MemoryProfile(
            weights_bytes=shape.weights_bytes, weights_source=shape.weights_source,
            kv_bytes_per_token=kv_bytes_per_token(shape, config.kv_cache_dtype,
                                                  cls.kv_cache_dtypes),
            kv_dtype=config.kv_cache_dtype,
            overheads=(Overhead("compute buffer", compute,
                                f"generic: {step} step tokens x (vocab + 4 x hidden) x 4 B"),))

    @abc.abstractmethod
    def load_weights(self) -> ModelInfo:
        """Load the model's weights and vocabulary; no KV cache yet."""

    @abc.abstractmethod
    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        """Allocate the fixed KV pool: ``num_tokens`` tokens (blocks of ``block_size``
        tokens on the paged layout) for at most
        ``max_num_seqs`` running sequences. Called once, at load, by the cache policy
        (``KVCache.allocate``)."""

    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The loaded model's tokenizer; called once, after ``load_weights``. It is used
        from any thread while steps run (the HTTP side tokenizes prompts on worker threads),
        so it shares no per-step state, and it must fail cleanly (``TokenizerClosedError``)
        rather than touch freed memory once ``close()`` ran."""

    @abc.abstractmethod
    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        """Prepare the sampler state of a new sequence (``StepItem.seq_id``). On the paged
        layout its KV is already placed by its block table; a streams-layout policy's own
        ops prepare its stream."""

    def trim_sequence(self, seq_id: int, num_tokens: int) -> None:
        """Drop sequence ``seq_id``'s KV from position ``num_tokens`` on (asked of a
        streams-layout backend with ``supports_draft_model``, whose draft instance keeps a
        stream per slot)."""
        raise NotImplementedError(f"the {self.name} backend trims no sequence")

    @abc.abstractmethod
    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        """Run all items in one batched forward pass.

        Returns one :class:`StepResult` per item: the sampled token where ``item.sample``, with
        its log-probability (and ``params.logprobs`` alternatives) when the sequence's
        ``SamplingParams.logprobs`` is not None; and the scores of ``item.score_targets``
        (only asked of backends with ``supports_prompt_logprobs``). Log-probabilities are
        the model's own (raw logits, before the mask, penalties and truncation).
        """

    @abc.abstractmethod
    def free_sequence(self, seq_id: int) -> None:
        """Drop the sampler state of a sequence that left (and, on the streams layout, the
        KV of its stream)."""

    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter at ``path`` (read_adapter's format) as ``name`` while serving
        (``POST /v1/load_lora_adapter``; only asked of a backend with ``supports_lora``,
        between two steps). The front end has read and checked the folder's headers
        against the model and kept its bytes within the plan (``max_loras``,
        ``max_lora_rank``); raise a ValueError that says what is wrong otherwise."""
        raise NotImplementedError(f"the {self.name} backend loads no adapters while serving")

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (between two steps, once no sequence uses it)."""
        raise NotImplementedError(f"the {self.name} backend unloads no adapters")

    def embed(self, token_ids: Sequence[int]) -> Sequence[float]:
        """The embedding of one input (only asked of a backend with ``supports_embeddings``):
        the final norm's hidden states of ``token_ids`` pooled as the model declares
        (``ModelShape.pooling``; else the last token's), as a 1-D float vector of the hidden
        size (a list or a numpy array). The core normalizes it to unit length.

        Called on the engine thread between two steps, never during one, with at most
        ``max_seq_len`` tokens, all inside the vocabulary. It must leave every running
        sequence's KV and sampler state as it found them; the memory it needs (a context or
        scratch KV of its own) is allocated by ``allocate_kv`` and counted by
        ``memory_profile`` as an ``embeddings`` line."""
        raise NotImplementedError(f"the {self.name} backend cannot compute embeddings")

    def embed_step(self, plan: EmbedPlan) -> Sequence[Sequence[float] | None]:
        """One embedding pass (laya_core/engine/embed_queue.py plans it after each step, of at most
        a quarter of ``max_step_tokens``): forget ``plan.dropped``, then feed every
        chunk of ``plan.chunks`` as one batch. Returns, per chunk, the input's pooled
        vector (as ``embed`` does) where ``chunk.last``, else None.

        A chunk continues its embedding sequence (``chunk.seq``) at ``chunk.start``; the
        sequences are the backend's own (below ``max_embed_inputs``), and the inputs begun
        at once hold at most ``max_seq_len`` tokens together. A sequence is free once its
        last chunk is in, or once dropped (which may name a sequence already forgotten).
        If it raises, the plan's inputs are dropped in the next plan. Without
        ``embeds_in_chunks`` each chunk is a whole input, one per plan, and this default
        runs ``embed`` on it."""
        return [self.embed(chunk.tokens) for chunk in plan.chunks]

    def load_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer without its weights, on an instance that was never loaded:
        for a front end whose replica runs in a worker process (laya_core/replica/worker_client.py),
        which tokenizes prompts itself. Called from any thread; it must be cheap in time and
        memory (a vocabulary, not a model). None, the default: the backend cannot, and its
        replicas run in the server's process."""
        return None

    def describe(self) -> dict[str, Any]:
        """How this instance runs, for the start-up log and ``/ready``: the hardware and
        library features in use, where the weights went, thread counts. Plain JSON values;
        called from any thread, after ``load_weights`` and between steps alike."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: not every backend holds resources
        """Release the model; the backend is not used afterwards."""
