"""The ExLlama backends' ``[models.options]`` and the sizes the libraries are given.

``device = "cuda:N"`` (default "cuda:0") puts the whole model on one GPU. ``gpu_split``
spreads it over several: a list of GiB of weights for cuda:0, cuda:1, ... (exllamav2's own
meaning; each layer's KV cache lives with the layer, and the last GPU listed takes whatever
the others leave), or "auto", which the memory plan turns into such a list in proportion to
each GPU's budget. The KV cache's element type is not an option: it is the manifest's
``kv_cache_dtype`` ("f16", "q8", "q6", "q4"), which the plan prices and suggests.
"""

from __future__ import annotations

import re
from typing import Any

from laya_core.backend import ModelConfig

OPTIONS: dict[str, str] = {
    "device": 'a GPU\'s name, "cuda:0" to "cuda:15"',
    "gpu_split": '"auto" or a list of GiB of weights for cuda:0, cuda:1, ... (1 to 16 '
                 'numbers above 0)',
}
DEFAULT_DEVICE = "cuda:0"
MAX_GPUS = 16
# The libraries' page: their cache is allocated, shared between prompts and reused in pages
# of this many tokens, and a prompt chunk is a whole number of them.
PAGE_TOKENS = 256
_DEVICE_RE = re.compile(r"^cuda:(\d{1,2})$")


def device_index(device: str) -> int | None:
    m = _DEVICE_RE.match(device)
    return int(m.group(1)) if m and int(m.group(1)) < MAX_GPUS else None


def _is_split(value: object) -> bool:
    return isinstance(value, list) and 1 <= len(value) <= MAX_GPUS and all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value)


def check(name: str, value: object) -> str | None:
    """A problem with option ``name``'s value, or None."""
    ok = {
        "device": isinstance(value, str) and device_index(value) is not None,
        "gpu_split": value == "auto" or _is_split(value),
    }[name]
    return None if ok else f"must be {OPTIONS[name]}, not {value!r}"


def check_together(opts: dict[str, Any]) -> dict[str, str]:
    if "device" in opts and "gpu_split" in opts:
        return {"gpu_split": "set either device (the whole model on one GPU) or gpu_split "
                             "(spread over several), not both"}
    return {}


def wanted_gpus(opts: dict[str, Any]) -> list[str]:
    """The GPUs the options name (for "auto", none in particular)."""
    split = opts.get("gpu_split")
    if isinstance(split, list):
        return [f"cuda:{i}" for i in range(len(split))]
    return [] if split == "auto" else [opts.get("device", DEFAULT_DEVICE)]


def pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


def max_seq_len(config: ModelConfig) -> int:
    return config.max_seq_len or 4096  # (a planned config has it decided)


def max_num_seqs(config: ModelConfig) -> int:
    return config.max_num_seqs or 1


def pool_tokens(config: ModelConfig) -> int:
    """The cache the library allocates: the planned pool rounded up to whole pages."""
    planned = config.kv_cache_tokens or max_seq_len(config) * max_num_seqs(config)
    return pages(planned) * PAGE_TOKENS


def chunk_tokens(config: ModelConfig) -> int:
    """The most prompt tokens one forward pass takes (the generator's ``max_chunk_size``
    and the model's ``max_input_len``): ``max_step_tokens`` rounded up to whole pages, as
    the library requires, and at least one token per running sequence (exllamav2 asks
    ``max_batch_size <= max_input_len`` of a decode pass)."""
    return pages(max(config.max_step_tokens, max_num_seqs(config))) * PAGE_TOKENS
