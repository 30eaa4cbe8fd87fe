"""KV-cache policies: where each sequence's KV lives, and what the backend must do about it.

A scheduler decides *who* runs; a :class:`KVCache` decides *where*: it admits a sequence when
its worst case (prompt + max_tokens) fits, finds the cached beginning of its prompt, gives it
a place in the pool (a block table, or a stream), and records the :class:`KVOp`\\ s the backend
must apply before the step that feeds it. The engine applies them in order.

A backend declares its layout (``Backend.kv_layout``): ``"paged"`` backends read block tables
from the core's :class:`PagedKVCache`; a ``"streams"`` backend keeps a KV stream per sequence
and brings its own policy through the cache-policy hook.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import attrs

from laya_core.kv.hashing import BLOCK_SIZE, cache_salt
from laya_core.kv.pool import KVManager

if TYPE_CHECKING:
    from laya_core.backend import Backend
    from laya_core.engine.request import Request
    from laya_core.types import SamplingParams


class KVOp(Protocol):
    """Something the backend does to its KV pool or sampler state before a step."""

    def apply(self, backend: Backend) -> None: ...


@attrs.frozen
class StartSequence:
    """A new sequence: its sampler state. Its KV is already placed by its block table."""

    seq_id: int
    params: SamplingParams

    def apply(self, backend: Backend) -> None:
        backend.start_sequence(self.seq_id, self.params)


@attrs.frozen
class FreeSequence:
    """A sequence that left: its sampler state (its blocks are the KV manager's)."""

    seq_id: int

    def apply(self, backend: Backend) -> None:
        backend.free_sequence(self.seq_id)


class KVCache(abc.ABC):
    """The KV pool of one replica, as a scheduler sees it."""

    layout: ClassVar[str]  # the Backend.kv_layout this policy serves

    def __init__(self, num_tokens: int, max_num_seqs: int, prefix_caching: bool = True,
                 block_size: int = BLOCK_SIZE) -> None:
        if num_tokens < block_size:
            raise ValueError(f"a KV pool of {num_tokens} tokens is smaller than one block")
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self._ops: list[KVOp] = []

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    @property
    @abc.abstractmethod
    def num_used_blocks(self) -> int:
        """Blocks that running sequences hold."""

    @property
    @abc.abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks of finished sequences kept for prefix reuse, given back when needed."""

    def allocate(self, backend: Backend) -> None:
        """Have the backend allocate the fixed pool, once, at load; the default asks for
        ``num_tokens`` tokens shared by ``max_num_seqs`` sequences (``Backend.allocate_kv``).
        A policy whose layout needs more of the backend overrides this."""
        backend.allocate_kv(num_tokens=self.num_tokens, max_num_seqs=self.max_num_seqs)

    def bind(self, waiting: Sequence[Request], running: Sequence[Request]) -> None:  # noqa: B027
        """The scheduler's queues, for policies that look at what waits or runs."""

    @abc.abstractmethod
    def can_admit(self, seq: Request) -> bool:
        """Whether ``seq``'s worst case fits now (cached KV counts as room)."""

    @abc.abstractmethod
    def admit(self, seq: Request) -> None:
        """Give ``seq`` its room and its cached prefix: ``seq.num_computed`` and
        ``seq.num_cached_tokens`` start there."""

    @abc.abstractmethod
    def finish(self, seq: Request, retain: bool) -> None:
        """``seq`` left; with ``retain`` its computed KV may stay for later prompts. The
        ops it records (``take_ops``) run before the next step."""

    def before_step(self) -> None:  # noqa: B027 - optional
        """Called once a step after admission: a policy may rearrange the pool."""

    @abc.abstractmethod
    def forget_adapter(self, name: str) -> None:
        """LoRA adapter ``name`` is being unloaded (no running sequence uses it): KV computed
        under it must never be reused, even by an adapter loaded later under that name. The
        ops it records run before the backend unloads the adapter."""

    def computed(self, seq: Request) -> None:  # noqa: B027 - optional
        """``seq.num_computed`` grew: its new KV exists."""

    def op_failed(self, op: KVOp) -> tuple[int, ...]:
        """The backend raised while applying ``op``, one of this policy's. Forget what the op
        was to make, and return the handles of the running sequences whose KV it was to
        prepare: the engine fails those and the step goes on without them. By default a
        failed ``StartSequence`` fails its sequence and other ops concern no one."""
        return (op.seq_id,) if isinstance(op, StartSequence) else ()

    def block_table(self, seq: Request) -> tuple[int, ...]:
        """The blocks of ``seq``, for paged backends; () for other layouts."""
        return ()

    def handle(self, seq: Request) -> int:
        """What the backend calls ``seq`` in ``StepItem.seq_id``: its sequence id, here."""
        return seq.seq_id

    def take_ops(self) -> tuple[KVOp, ...]:
        """The operations recorded since the last call, in the order they must run."""
        ops, self._ops = tuple(self._ops), []
        return ops


def max_reuse_tokens(seq: Request, prefix_caching: bool) -> int:
    """How much of ``seq``'s prompt may come from the cache.

    Nothing for a prompt whose log-probabilities are wanted (cached KV has no logits); else
    all but the prompt's last chunk (``Request.min_last_chunk``, the backend's): one token
    gives the logits the first output is sampled from, and a backend whose one-token batch
    takes other kernel paths than the longer chunk it replaces asks for more.
    """
    if not prefix_caching or seq.scores_prompt:
        return 0
    return max(0, seq.num_prompt_tokens - seq.min_last_chunk)


class PagedKVCache(KVCache):
    """The core's policy for paged backends: the :class:`KVManager`'s blocks.

    Admission reserves the worst case in blocks (a running sequence is never preempted);
    full blocks are indexed as they are computed, so running sequences share them too, and a
    finished sequence's blocks stay cached until their room is needed.
    """

    layout = "paged"

    def __init__(self, num_tokens: int, max_num_seqs: int, prefix_caching: bool = True,
                 block_size: int = BLOCK_SIZE) -> None:
        super().__init__(num_tokens, max_num_seqs, prefix_caching, block_size)
        self.blocks = KVManager(self.num_blocks, block_size)
        self._num_running = 0
        self._loads: dict[str, int] = {}  # adapter name -> times it was unloaded

    def _salt(self, seq: Request) -> int | None:
        lora = seq.params.lora
        return cache_salt(lora, self._loads.get(lora, 0)) if lora is not None else None

    def forget_adapter(self, name: str) -> None:
        """Blocks cached under ``name`` stay until their room is needed, but its later loads
        hash from another salt, so they never match."""
        self._loads[name] = self._loads.get(name, 0) + 1

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.blocks.num_cached_blocks

    def can_admit(self, seq: Request) -> bool:
        return self._num_running < self.max_num_seqs and self.blocks.can_allocate(
            seq.prompt_token_ids, seq.max_total_tokens,
            max_reuse_tokens(seq, self.prefix_caching), self._salt(seq))

    def admit(self, seq: Request) -> None:
        hit = self.blocks.allocate(seq.seq_id, seq.prompt_token_ids, seq.max_total_tokens,
                                   max_reuse_tokens(seq, self.prefix_caching),
                                   self._salt(seq))
        seq.num_computed = seq.num_cached_tokens = hit
        self._num_running += 1
        self._ops.append(StartSequence(seq.seq_id, seq.params))

    def finish(self, seq: Request, retain: bool) -> None:
        if retain and self.prefix_caching:
            self.computed(seq)
        self.blocks.free(seq.seq_id)
        self._num_running -= 1
        self._ops.append(FreeSequence(seq.seq_id))

    def computed(self, seq: Request) -> None:
        full = seq.num_computed // self.block_size
        if self.prefix_caching and full > self.blocks.num_indexed_blocks(seq.seq_id):
            self.blocks.cache_blocks(seq.seq_id, seq.computed_token_ids)

    def block_table(self, seq: Request) -> tuple[int, ...]:
        return self.blocks.block_table(seq.seq_id)
