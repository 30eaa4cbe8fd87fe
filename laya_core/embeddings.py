"""Embeddings: the pooling a model declares, L2 normalization, and the engine's embed jobs.

A backend that embeds (``Backend.supports_embeddings``) returns one pooled hidden state per
input (the final norm's output, pooled as the model declares: GGUF ``<arch>.pooling_type``
or a sentence-transformers ``Pooling`` module; else the last token, which is what a causal
decoder's last position has read). The core normalizes it to unit length, in float64, and
hands it to the HTTP side as little-endian float32 bytes: immutable, and already what
``encoding_format = "base64"`` sends.

Embedding work runs on the replica's engine thread between two steps, one input at a time
(:class:`EmbedJob`), never beside a step: the two would share the backend's weights and
the same cores, and on a CPU two thread pools on the same cores slow each other down many
times over (docs/architecture.md, "Threads").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

# GGUF's ``<arch>.pooling_type`` (llama.cpp's enum llama_pooling_type): 0 none, 1 mean,
# 2 cls, 3 last, 4 rank. "none" (per-token vectors) and "rank" (a reranker's score) are no
# single embedding, so they fall back to the default like a model that declares nothing.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
POOLINGS = ("mean", "cls", "last")
DEFAULT_POOLING = "last"
# sentence-transformers' Pooling config keys, by the pooling they switch on.
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_lasttoken": "last"}


class EmbeddingsUnsupportedError(ValueError):
    """The replica's backend cannot compute embeddings."""


def pooling_of_gguf(value: object) -> str | None:
    """The pooling a GGUF ``<arch>.pooling_type`` value names, or None."""
    return GGUF_POOLING.get(value) if isinstance(value, int) else None


def pooling_of_folder(folder: Path) -> str | None:
    """The pooling of a Hugging Face folder's sentence-transformers ``Pooling`` module
    (``modules.json`` names its folder, whose ``config.json`` switches one mode on), or
    None where there is none or it asks for a mode not in :data:`POOLINGS`."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        path = next(m.get("path", "") for m in modules
                    if str(m.get("type", "")).endswith("models.Pooling"))
        config = json.loads((folder / path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    if not isinstance(config, dict):
        return None
    chosen = [pooling for key, pooling in _ST_POOLING.items() if config.get(key) is True]
    return chosen[0] if len(chosen) == 1 else None


def unit_float32(vector: Any) -> bytes:
    """``vector`` scaled to unit L2 norm (computed in float64), as little-endian float32."""
    v = np.asarray(vector, dtype=np.float64).ravel()
    norm = float(np.linalg.norm(v))
    if not np.isfinite(norm):
        raise ValueError("the model's hidden state is not finite")
    if norm > 0:
        v = v / norm
    return v.astype("<f4").tobytes()


@attrs.frozen
class Embeddings:
    """What an embed request produced: one unit vector per input, in order."""

    vectors: tuple[bytes, ...]  # little-endian float32, unit L2 norm
    num_tokens: int  # the inputs' tokens, all of them


@attrs.define
class EmbedJob:
    """One embed request on its way through the engine thread: its inputs, computed one
    per turn between steps, and the future that gets the result on the caller's loop."""

    inputs: Sequence[Sequence[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Embeddings]
    vectors: list[bytes] = attrs.field(factory=list)

    @property
    def done(self) -> bool:
        return len(self.vectors) == len(self.inputs) or self.future.cancelled()

    def run_next(self, embed: Callable[[Sequence[int]], Any]) -> None:
        """Embed the next input with ``embed`` (the backend's); on the engine thread."""
        try:
            self.vectors.append(unit_float32(embed(self.inputs[len(self.vectors)])))
        except Exception as e:  # noqa: BLE001 - the request fails, the replica serves on
            self.resolve(RuntimeError(f"embedding failed: {type(e).__name__}: {e}"))
            self.vectors = [b""] * len(self.inputs)
            return
        if len(self.vectors) == len(self.inputs):
            self.resolve(Embeddings(tuple(self.vectors), sum(map(len, self.inputs))))

    def resolve(self, outcome: Embeddings | BaseException) -> None:
        """Hand ``outcome`` to the caller's loop (a result, or an error to raise)."""
        def settle() -> None:
            if self.future.done():  # cancelled: the client went away
                return
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for this request
            pass
