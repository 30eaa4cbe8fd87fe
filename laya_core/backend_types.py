"""What the engine and a backend hand each other: a model's configuration (``ModelConfig``),
what its weights and KV cost (``MemoryProfile``), what a load found (``ModelInfo``), and a
step's items and results (``StepItem``, ``StepResult``). The backend contract itself, the
methods, is :mod:`laya_core.backend`, which names these too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from laya_core.types import Sample, SpeculativeConfig

if TYPE_CHECKING:
    from laya_core.engine.allowed_tokens import AllowedTokens


@attrs.frozen
class ModelConfig:
    """One ``[[models]]`` entry of the manifest, validated, with its path resolved."""

    name: str
    backend: str
    path: str
    max_seq_len: int | None = None  # None: the smaller of 4096 and the model's own
    max_num_seqs: int | None = None  # None: 4, or what kv_cache_tokens holds
    replicas: int = 1
    max_step_tokens: int = 512
    scheduler: str = "fcfs"
    cache_policy: str = "auto"  # "auto": the registered one serving the backend's kv_layout
    kv_cache_tokens: int | None = None  # the KV pool; None: max_seq_len x max_num_seqs
    kv_cache_dtype: str = "f16"
    prefix_caching: bool = True  # reuse KV of prompts' known beginnings
    routing: str = "prefix"  # the router policy among this model's replicas
    max_queue: int = 64  # requests waiting for room; more get 429
    queue_timeout_s: float = 30.0  # a request waiting longer gets 503
    options: dict[str, Any] = attrs.field(factory=dict)
    # /v1/embeddings for this model: the backend then holds memory of its own for one
    # input of max_seq_len (planned); off by default, since a generation-only deployment
    # would pay for it on every replica (a 7B model at 32k: 16 GiB of KV).
    embeddings: bool = False
    # The family's tool-call format (laya_core/structured/tool_formats.py), or "auto": the
    # one its chat template shows.
    tool_call_format: str = "auto"
    # "always": loaded with the server, never unloaded; "on_demand": loaded at its first
    # request and unloaded when idle for idle_unload_s (None: only when another model needs
    # the room), by the memory plan (laya_core/serving/residency.py).
    load: str = "always"
    idle_unload_s: float | None = None
    # How the model writes its reasoning (laya_core/structured/reasoning.py): "auto" (what
    # its chat template shows), "think" or "none"; and the default thinking budget in tokens
    # (None: none).
    reasoning_format: str = "auto"
    max_reasoning_tokens: int | None = None
    # Speculative decoding (laya_core/engine/speculative.py); None: off.
    speculative: SpeculativeConfig | None = None
    # LoRA adapters served beside the base model: name -> the adapter in the backend's
    # format (Backend.read_adapter: a PEFT folder, or llama.cpp's GGUF file). A request
    # names one as its ``model``.
    lora: dict[str, str] = attrs.field(factory=dict)
    # Adapters loaded at once, those of ``lora`` and those loaded while serving
    # (POST /v1/load_lora_adapter); None: as many as ``lora`` lists. The plan holds room
    # for each extra one at ``max_lora_rank`` (None: the largest rank of ``lora``, else 16).
    max_loras: int | None = None
    max_lora_rank: int | None = None
    # The longest a generated token waits for the tokens after it, so that a few steps'
    # tokens leave the engine in one hand-over (0: every step's at once). First tokens, final
    # events and steps that feed a prompt never wait (laya_core/engine/engine.py).
    stream_interval_ms: float = 20.0

    @property
    def lora_slots(self) -> int:
        """Adapters loaded at once at most."""
        return len(self.lora) if self.max_loras is None else self.max_loras

    @property
    def on_demand(self) -> bool:
        return self.load == "on_demand"


@attrs.frozen
class Overhead:
    """One line of a replica's memory beyond its weights and KV pool."""

    name: str
    bytes: int
    how: str  # how the number was obtained
    # What the replicas of one process share, such as a backend library's code: a key, and
    # the plan counts the overheads under one key once (the largest). None: per replica.
    shared: str | None = None
    # Where the bytes live: "cpu" (the host's RAM) or a GPU ("cuda:0"), whose budget the
    # plan checks them against (laya_core/memory/devices.py).
    device: str = "cpu"


@attrs.frozen
class MemoryProfile:
    """What one replica of a model costs, as its backend reports it (``memory_profile``);
    the memory ledger (``laya_core/memory/ledger.py``) sums it against the budget."""

    weights_bytes: int
    weights_source: str
    kv_bytes_per_token: int
    kv_dtype: str
    overheads: tuple[Overhead, ...]
    # The parts of the weights and of each token's KV that live on a GPU, by device
    # ("cuda:0" -> bytes); the rest of each is in host RAM. Empty: all on the host.
    weights_on: Mapping[str, int] = attrs.field(factory=dict)
    kv_bytes_per_token_on: Mapping[str, int] = attrs.field(factory=dict)


@attrs.frozen
class ModelInfo:
    """What the core needs to know about a loaded model."""

    n_ctx_train: int
    vocab_size: int
    eog_token_ids: frozenset[int]
    chat_template: str | None
    bos_token: str
    eos_token: str
    add_bos: bool
    description: str = ""
    # Texts that ``encode(..., parse_special=True)`` turns into control tokens; message
    # content holding them is tokenized as text instead (laya_core/serving/chat_prompt.py).
    special_tokens: frozenset[str] = frozenset()


@attrs.frozen
class StepItem:
    """Feed ``tokens`` to sequence ``seq_id`` at positions ``start_pos ..``; sample if asked.

    ``score_targets`` asks for prompt log-probabilities: ``score_targets[j]`` is the token
    that follows ``tokens[j]``, to be scored under the model's distribution at row ``j``
    (its log-probability, its rank and the ``score_top`` likeliest tokens). It holds one
    target per fed token, or one fewer where the last row samples instead. The scheduler
    keeps the scored rows of a step within ``memory.ledger.scored_tokens_per_step``, so the
    logits they need are in the memory plan.

    ``allowed_tokens`` (only where ``sample``; None: no constraint) is the set the sampled
    token must come from. The backend masks every other token out before it samples, so
    penalties, top-k, top-p, min-p, temperature and the draw (or the greedy pick) work on
    the allowed tokens only, and a masked token is never sampled. Log-probabilities are
    still the model's own, unmasked. A mask that allows nothing fails this item alone
    (``StepResult.error``).

    ``draft`` (only where ``sample``) is the tail of ``tokens`` that a drafter guessed
    (laya_core/engine/speculative.py): the backend samples the row before the draft, and
    while the token it samples is the draft's next one, the row after it too, with the
    sequence's own sampler, and then drops the KV of the draft tokens it did not keep
    (positions from ``start_pos + len(tokens) - len(draft) + accepted``). Only backends that
    say ``supports_speculative`` are given drafts. A constrained sequence's draft comes with
    ``draft_allowed``: the mask of the row after each draft token (the grammar's state
    once that token is taken), applied to that row's sample as ``allowed_tokens`` is to the
    first; a row whose mask allows nothing is not sampled (the draft ends there). Empty:
    those rows are free. Every draft token is allowed by the mask of the row before it, so a
    row's sample is the one a plain decode of the same text would draw.
    """

    # The backend's name for the sequence (``KVCache.handle``): its sequence id on the paged
    # layout; on the streams layout, whatever the backend's own cache policy hands out.
    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    sample: bool
    score_targets: Sequence[int] = ()
    score_top: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    allowed_tokens: AllowedTokens | None = None
    # Paged layouts (``Backend.kv_layout == "paged"``): the pool blocks holding positions
    # 0 .. of this sequence, ``block_size`` tokens each; position p is in
    # ``block_table[p // block_size]``. Blocks before ``start_pos`` may be shared with other
    # sequences (a cached prefix) and are only read. Empty for the streams layout.
    block_table: Sequence[int] = ()
    draft: Sequence[int] = ()
    draft_allowed: Sequence[AllowedTokens | None] = attrs.field(default=())

    @property
    def draft_masks(self) -> Sequence[AllowedTokens | None]:
        """The mask of the row after each draft token: ``draft_allowed``, or None each."""
        return self.draft_allowed or (None,) * len(self.draft)

    @draft_allowed.validator
    def _one_mask_a_draft_token(self, attribute: attrs.Attribute[Any],
                                masks: Sequence[AllowedTokens | None]) -> None:
        if masks and len(masks) != len(self.draft):
            raise ValueError(f"draft_allowed holds {len(masks)} masks for a draft of "
                             f"{len(self.draft)} tokens: one a draft token, or none")


@attrs.frozen
class StepResult:
    """What one :class:`StepItem` produced."""

    sample: Sample | None = None  # the sampled token, where ``item.sample``
    scores: tuple[Sample, ...] = ()  # one per ``item.score_targets``, in order, with ranks
    # Why this item could not be sampled (its mask allowed no token), said to the client;
    # the engine fails its sequence alone, and the rest of the step stands.
    error: str | None = None
    # Where the item had a draft: the tokens sampled after ``sample``, one per draft token
    # kept (each row's token was the draft's next one, so the row after it was sampled too).
    accepted: tuple[Sample, ...] = ()
