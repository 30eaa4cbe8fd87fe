"""Where one replica's GPU memory goes: which GPUs hold which layers, and each one's scratch.

The memory plan and the load use the same :class:`Placement`, so what the plan counted on a
GPU is what the library is asked to put there. With a ``gpu_split`` the layers fill the GPUs
in order, each up to its share less its scratch, as exllamav2's ``set_device_map`` fills
them; the head and the final norm come last; the last GPU takes whatever is left. (The
library fills module by module, attention and MLP apart, so a layer on a boundary may land
on the next GPU: not yet compared on a GPU, tools/gpu_check.sh.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from laya_backend_exl2 import options
from laya_backend_exl2.folder import Folder
from laya_core.backend import ModelConfig
from laya_core.models.files import ModelShape

GIB = 2**30
# exllamav2 dequantizes a quantized matrix into an fp16 scratch for long inputs (cuBLAS is
# faster there than its own kernels), at most this many elements at once (config.max_dq_size).
MAX_DEQUANT_ELEMENTS = 512 * 2**20


@attrs.frozen
class Scratch:
    """One GPU's working memory beside its weights and KV, and how it was estimated."""

    bytes: int
    how: str


def scratch(config: ModelConfig, shape: ModelShape, folder: Folder, with_head: bool) -> Scratch:
    """A GPU's scratch, estimated after exllamav2's own sizing (its modules' temp_*_size):
    for a chunk of ``chunk_tokens`` in fp16, the MLP's state and two intermediate buffers,
    the hidden state, and attention's q, k, v; attention's scores where flash-attn does not
    compute them (exllamav2 bounds them to chunk x chunk per head, its temp_attn_size); the
    dequantization buffer of the largest matrix; the rotary tables; and where the head is,
    the sampled rows' float32 logits with the sampler's copy."""
    chunk = options.chunk_tokens(config)
    hidden, vocab = shape.hidden_size, shape.vocab_size
    inter = int(folder.config.get("intermediate_size") or 4 * hidden)
    q_dim, kv_dim = shape.n_heads * shape.head_dim_k, shape.n_kv_heads * shape.head_dim_k
    mlp = chunk * (hidden + 2 * max(hidden, inter)) * 2
    attention = chunk * (hidden + q_dim + 2 * kv_dim) * 2
    scores = 2 * chunk * chunk * shape.n_heads * 2
    largest = min(MAX_DEQUANT_ELEMENTS,
                  max(hidden * inter, hidden * q_dim, vocab * hidden if with_head else 0))
    dequant = 2 * largest
    rotary = 2 * shape.head_dim_k * options.max_seq_len(config) * 2
    rows = options.max_num_seqs(config)
    logits = rows * vocab * 4 * 2 if with_head else 0
    how = (f"estimate: a chunk of {chunk} tokens x (MLP {hidden} + 2 x {max(hidden, inter)}"
           f" + attention {hidden + q_dim + 2 * kv_dim}) x 2 B, its scores ({chunk}^2 x "
           f"{shape.n_heads} heads x 2 x 2 B, without flash-attn), a {largest}-element fp16 "
           "dequantization buffer, rotary tables")
    if with_head:
        how += f", {rows} rows of float32 logits and the sampler's copy"
    return Scratch(mlp + attention + scores + dequant + rotary + logits, how)


@attrs.frozen
class Placement:
    """The GPUs one replica uses, in order, with the layers and weights each holds."""

    devices: tuple[str, ...]
    layers: tuple[int, ...]  # how many of the model's layers each holds
    weights: tuple[int, ...]  # bytes of weights each holds (the head: the last one's)
    scratch: tuple[Scratch, ...]

    @property
    def head_device(self) -> str:
        return self.devices[-1]

    def split_gib(self, with_kv_per_token: int = 0, pool_tokens: int = 0) -> list[float]:
        """Each GPU's share in GiB, one entry per GPU from cuda:0 (0 for those it leaves
        out), the last one open-ended: exllamav2's ``gpu_split`` (weights and scratch), or
        with the KV of each layer, exllamav3's ``use_per_device``."""
        share = {d: (w + s.bytes + n * with_kv_per_token * pool_tokens) / GIB
                 for d, w, s, n in zip(self.devices, self.weights, self.scratch, self.layers,
                                       strict=True)}
        last = max(options.device_index(d) or 0 for d in self.devices)
        out = [round(share.get(f"cuda:{i}", 0.0), 6) for i in range(last + 1)]
        out[-1] = 1024.0  # the rest on the last GPU, as planned
        return out


def _fill(sizes: Sequence[int], room: Sequence[int]) -> list[int]:
    """The GPU of each module (by position in ``room``): the first, from the current one,
    with room for it; the last GPU takes what the others cannot."""
    out, used, d = [], [0] * len(room), 0
    for size in sizes:
        while d < len(room) - 1 and used[d] + size > room[d]:
            d += 1
        out.append(d)
        used[d] += size
    return out


def placement(config: ModelConfig, shape: ModelShape, folder: Folder) -> Placement:
    """Where ``config``'s options put the model (``gpu_split`` "auto" not yet decided:
    the first GPU, as ``device``'s default)."""
    split = config.options.get("gpu_split")
    if not isinstance(split, list):
        device = config.options.get("device", options.DEFAULT_DEVICE)
        return Placement((device,), (len(folder.layer_bytes),), (folder.gpu_weights_bytes,),
                         (scratch(config, shape, folder, True),))
    plain = scratch(config, shape, folder, False)
    head = scratch(config, shape, folder, True)
    room = [int(gib * GIB) - head.bytes for gib in split]
    where = _fill([*folder.layer_bytes, folder.head_bytes], room)
    used = sorted(set(where))
    layers = [where[:-1].count(d) for d in used]
    weights = [sum(b for b, w in zip(folder.layer_bytes, where, strict=False) if w == d)
               for d in used]
    weights[-1] += folder.head_bytes  # the head comes last: on the last GPU used
    return Placement(tuple(f"cuda:{d}" for d in used), tuple(layers), tuple(weights),
                     (*[plain] * (len(used) - 1), head))


def auto_split(config: ModelConfig, shape: ModelShape, folder: Folder,
               budgets: Sequence[int]) -> list[float]:
    """``gpu_split = "auto"`` for GPUs with these budgets (bytes, of cuda:0, cuda:1, ...):
    the weights in proportion to each budget, so that each GPU's layers, and so their KV,
    take the same share of it; plus each one's scratch."""
    total = sum(budgets) or 1
    reserve = scratch(config, shape, folder, True).bytes
    return [round((folder.gpu_weights_bytes * b / total + reserve) / GIB, 6) for b in budgets]


def decided(config: ModelConfig, split: list[float]) -> ModelConfig:
    opts: dict[str, Any] = {**config.options, "gpu_split": split}
    return attrs.evolve(config, options=opts)
