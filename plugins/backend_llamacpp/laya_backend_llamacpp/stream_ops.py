"""The ops of the llama.cpp cache policy (``streams.StreamsKVCache``): what the backend does
to its KV streams before a step, in the order the policy decided it. Each calls the llama.cpp
backend's own methods; the core only calls ``apply``."""

from __future__ import annotations

from typing import Any

import attrs
from laya_core.types import SamplingParams


@attrs.frozen
class StartStream:
    """A new sequence in ``slot``: its sampler; its stream keeps the first ``keep_tokens``
    positions (a retained slot taken over), or gets ``num_copied`` from ``copy_from``."""

    slot: int
    params: SamplingParams
    keep_tokens: int = 0
    copy_from: int | None = None
    num_copied: int = 0
    restore: int | None = None  # or: its first num_copied tokens come from saved KV

    def apply(self, backend: Any) -> None:
        backend.start_sequence(self.slot, self.params, keep_tokens=self.keep_tokens)
        if self.copy_from is not None:
            backend.share_prefix(self.copy_from, self.slot, self.num_copied)
        elif self.restore is not None:
            backend.restore_stream(self.restore, self.slot, self.num_copied)


@attrs.frozen
class DropStream:
    """``slot``'s stream and sampler go: a sequence left, or retained KV is evicted."""

    slot: int

    def apply(self, backend: Any) -> None:
        backend.free_sequence(self.slot)


@attrs.frozen
class SaveStream:
    """``slot``'s KV is copied to host memory as ``key`` (before the slot is dropped)."""

    slot: int
    key: int

    def apply(self, backend: Any) -> None:
        backend.save_stream(self.slot, self.key)


@attrs.frozen
class ForgetSaved:
    """Saved KV ``key`` is given up, to make room for newer."""

    key: int

    def apply(self, backend: Any) -> None:
        backend.forget_saved(self.key)


@attrs.frozen
class MoveStream:
    """``num_tokens`` of KV move from ``src`` to the free ``dst``: retained KV out of the
    way, or (``running``) a running sequence with its sampler, closing a hole."""

    src: int
    dst: int
    num_tokens: int
    running: bool = False

    def apply(self, backend: Any) -> None:
        if self.running:
            backend.move_sequence(self.src, self.dst, self.num_tokens)
        else:
            backend.share_prefix(self.src, self.dst, self.num_tokens)
            backend.free_sequence(self.src)
