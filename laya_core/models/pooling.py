"""The pooling a model declares for embeddings, read from its files.

A GGUF file says it in ``<arch>.pooling_type``, a Hugging Face folder in its
sentence-transformers ``Pooling`` module. The engine's embed jobs (``laya_core/engine/
embed_jobs.py``) pool as declared, or take the last token where a model declares nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

# GGUF's ``<arch>.pooling_type`` (llama.cpp's enum llama_pooling_type): 0 none, 1 mean,
# 2 cls, 3 last, 4 rank. "none" (per-token vectors) and "rank" (a reranker's score) are no
# single embedding, so they fall back to the default like a model that declares nothing.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
POOLINGS = ("mean", "cls", "last")
DEFAULT_POOLING = "last"
# sentence-transformers' Pooling config keys, by the pooling they switch on.
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_lasttoken": "last"}


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
