"""LoRA adapters on the torch backend, applied per row so one step mixes adapters.

An adapter (a PEFT folder, checked by laya_core/models/lora.py) adds ``s B A x`` to the
output of each linear layer it adapts. The model fuses q/k/v and gate/up into one matrix
each (model.py), so the adapter's matrices are fused the same way: the A matrices of the
modules sharing an input stacked ([modules x r, in]), and their B matrices placed
block-diagonally ([fused out, modules x r]) with the scale folded in. A layer's output then
takes one pair of small products per adapter, for the rows of the sequences that use it.

The matrices stay in float32 whatever the compute dtype: they are small (SmolLM2-135M, rank
8 on every module: 4.9 MB), and the update is added to the base output in its own dtype.
With ``deterministic = true`` they are float64, as attention is there (model._attend): a
float32 product's last bits change with the number of rows in the call (rank 8 against 576
inputs: at every count from 2 rows on), and cast to bfloat16 such a difference still moves a
few of a token's 180,000 updated values by a step, so a row's logits would depend on its
batch. In float64 the differences stay far below what the cast keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from laya_backend_torch.checkpoint import LlamaConfig
from laya_core.models.lora import Adapter, AdapterError, read_adapter

# The model's fused matrices and the modules each stacks, in output order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@attrs.frozen
class LoraWeights:
    """One adapter, fused as the model's layers are: per layer, fused name -> (A, B)."""

    name: str
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


# The rows of a step that use one adapter: (weights, rows), rows None meaning every row.
LoraRows = Sequence[tuple[LoraWeights, "torch.Tensor | None"]]


def sizes(c: LlamaConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Each fused matrix's parts' output features (q, k, v; gate, up) and its input
    features."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    outs = {"qkv": (q, kv, kv), "o": (c.hidden_size,),
            "gate_up": (c.intermediate_size, c.intermediate_size), "down": (c.hidden_size,)}
    ins = {"qkv": c.hidden_size, "o": q, "gate_up": c.hidden_size, "down": c.intermediate_size}
    return outs, ins


def dtype_for(deterministic: bool) -> torch.dtype:
    """The adapters' matrices' dtype: float64 where a row's logits must not depend on its
    batch (``deterministic``), else float32."""
    return torch.float64 if deterministic else torch.float32


def fused_bytes(adapter: Adapter, c: LlamaConfig, element: int = 4) -> int:
    """Bytes the adapter holds once fused (``load``): its A matrices, and per fused matrix
    a B of the fused output by the stacked ranks, ``element`` bytes each."""
    outs, _ = sizes(c)
    a_elements = sum(t.shape[0] * t.shape[1] for t in adapter.tensors if t.part == "A")
    stacked: dict[tuple[int, str], int] = {}
    for t in adapter.tensors:
        if t.part == "A":
            key = next(k for k, modules in FUSED.items() if t.module in modules)
            stacked[(t.layer, key)] = stacked.get((t.layer, key), 0) + adapter.rank
    b_elements = sum(sum(outs[key]) * ranks for (_, key), ranks in stacked.items())
    return element * (a_elements + b_elements)


def largest_bytes(rank: int, c: LlamaConfig, element: int = 4) -> int:
    """Bytes of the largest adapter of ``rank``: every module of every layer adapted."""
    outs, ins = sizes(c)
    per_layer = sum(len(outs[key]) * rank * (ins[key] + sum(outs[key])) for key in FUSED)
    return element * c.num_layers * per_layer


def load(name: str, adapter: Adapter, c: LlamaConfig, device: torch.device,
         dtype: torch.dtype = torch.float32) -> LoraWeights:
    """The adapter's tensors read, checked against the model's sizes and fused, in
    ``dtype`` (``dtype_for``)."""
    from safetensors.torch import load_file

    out_sizes, in_sizes = sizes(c)
    num_layers = c.num_layers

    try:
        raw = load_file(str(adapter.path / "adapter_model.safetensors"))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own kinds for a bad file
        raise AdapterError(f"{adapter.path}: the weights could not be read: {e}") from None
    by_module = {(t.layer, t.module, t.part): raw[t.name] for t in adapter.tensors}
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(num_layers):
        fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, modules in FUSED.items():
            present = [j for j, m in enumerate(modules) if (i, m, "A") in by_module]
            if not present:
                continue
            r = adapter.rank
            a = torch.cat([by_module[(i, modules[j], "A")].float() for j in present])
            if a.shape[1] != in_sizes[key]:
                raise AdapterError(f"{adapter.path}: layers.{i}.{modules[present[0]]} takes "
                                   f"{a.shape[1]} input features, the model's "
                                   f"{in_sizes[key]}")
            parts = out_sizes[key]
            b = torch.zeros(sum(parts), len(present) * r)
            for col, j in enumerate(present):
                bj = by_module[(i, modules[j], "B")].float()
                if bj.shape[0] != parts[j]:
                    raise AdapterError(f"{adapter.path}: layers.{i}.{modules[j]} gives "
                                       f"{bj.shape[0]} output features, the model's "
                                       f"{parts[j]}")
                start = sum(parts[:j])
                b[start:start + parts[j], col * r:(col + 1) * r] = bj * adapter.scale
            fused[key] = (a.contiguous().to(device=device, dtype=dtype),
                          b.to(device=device, dtype=dtype))
        layers.append(fused)
    return LoraWeights(name, tuple(layers))


def apply(y: torch.Tensor, x: torch.Tensor, groups: LoraRows, layer: int,
          key: str) -> torch.Tensor:
    """``y`` (the base output of fused matrix ``key`` of ``layer`` for input ``x``) with each
    group's adapter update added on its rows."""
    for weights, rows in groups:
        pair = weights.layers[layer].get(key)
        if pair is None:
            continue
        a, b = pair
        xs = x if rows is None else x.index_select(0, rows)
        delta = ((xs.to(a.dtype) @ a.T) @ b.T).to(y.dtype)
        y = y + delta if rows is None else y.index_add(0, rows, delta)
    return y


def rows_by_adapter(adapters: Sequence[LoraWeights | None], lengths: Sequence[int],
                    device: Any) -> list[tuple[LoraWeights, torch.Tensor | None]]:
    """The step's rows grouped by adapter, from each item's adapter (None: the base) and
    its row count; a group holding every row gives None for its rows."""
    total = sum(lengths)
    rows: dict[str, tuple[LoraWeights, list[int]]] = {}
    first = 0
    for weights, n in zip(adapters, lengths, strict=True):
        if weights is not None:
            rows.setdefault(weights.name, (weights, []))[1].extend(range(first, first + n))
        first += n
    return [(w, None if len(r) == total else torch.tensor(r, dtype=torch.long, device=device))
            for w, r in rows.values()]


class Adapters:
    """A backend's loaded adapters, by name, and the adapter each sequence uses."""

    def __init__(self, c: LlamaConfig, device: torch.device, deterministic: bool) -> None:
        self.config, self.device, self.dtype = c, device, dtype_for(deterministic)
        self.loaded: dict[str, LoraWeights] = {}
        self._by_seq: dict[int, LoraWeights] = {}

    def load(self, name: str, path: str) -> LoraWeights:
        """Read, check and fuse the adapter at ``path`` (``load``) under ``name``."""
        if name in self.loaded:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        self.loaded[name] = load(name, read_adapter(path), self.config, self.device, self.dtype)
        return self.loaded[name]

    def unload(self, name: str) -> None:
        if any(w.name == name for w in self._by_seq.values()):
            raise ValueError(f"adapter {name!r} is in use")  # (the engine waits for that)
        self.loaded.pop(name, None)

    def start(self, seq_id: int, name: str) -> None:
        if name not in self.loaded:
            raise ValueError(f"no LoRA adapter {name!r} is loaded")
        self._by_seq[seq_id] = self.loaded[name]

    def free(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)

    def rows(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> LoraRows:
        """The step's rows by adapter (``rows_by_adapter``); none while no sequence uses one."""
        if not self._by_seq:
            return ()
        return rows_by_adapter([self._by_seq.get(s) for s in seq_ids], lengths, self.device)
