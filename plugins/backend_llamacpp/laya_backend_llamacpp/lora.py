"""LoRA adapters on llama.cpp: GGUF adapter files, one set applied per ``llama_decode``.

llama.cpp sets adapters on a context (``llama_set_adapters_lora``), and every row of a
``llama_decode`` goes through them, so sequences of different adapters cannot share one
batch. :meth:`LoraAdapters.groups` splits a step's sequences by adapter, the one set on the
context first (a switch costs a graph rebuild), and the backend runs each group's passes
under its adapter: every sequence still advances every step, and a mix of N adapters costs
about N decodes of the smaller groups (``tools/benchmark_lora.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any


class LoraAdapters:
    """The adapters loaded on one model, which slot uses which, and the one applied."""

    def __init__(self, ll: Any, model: Any) -> None:
        self._ll, self._model = ll, model
        self._handles: dict[str, Any] = {}  # name -> llama_adapter_lora
        self._slots: dict[int, str] = {}  # slot -> the adapter its sequence uses
        self._applied: str | None = None  # what the context runs under now
        self.described: dict[str, dict[str, Any]] = {}  # name -> path and bytes (/ready)

    def load(self, name: str, path: str) -> None:
        """Load the GGUF adapter at ``path`` (checked against the model before this)."""
        from laya_core.models.lora import read_gguf_adapter

        if name in self._handles:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        adapter = read_gguf_adapter(path)
        handle = self._ll.llama_adapter_lora_init(self._model, path.encode())
        if not handle:
            raise ValueError(f"llama.cpp could not load the LoRA adapter {path} (its log "
                             "says why: an adapter of another model, or a damaged file)")
        self._handles[name] = handle
        self.described[name] = {"path": path, "bytes": adapter.nbytes}

    def unload(self, name: str, ctx: Any) -> None:
        if name in self._slots.values():
            raise ValueError(f"adapter {name!r} is in use")  # (the engine waits for that)
        handle = self._handles.pop(name, None)
        self.described.pop(name, None)
        if handle is None:
            return
        if self._applied == name and ctx:
            self.apply(None, ctx)
        self._ll.llama_adapter_lora_free(handle)

    def check(self, name: str | None) -> None:
        if name is not None and name not in self._handles:
            raise ValueError(f"no LoRA adapter {name!r} is loaded")

    def bind(self, slot: int, name: str | None) -> None:
        """The sequence in ``slot`` uses adapter ``name`` (None: the base model)."""
        if name is None:
            self._slots.pop(slot, None)
        else:
            self._slots[slot] = name

    def move(self, src: int, dst: int) -> None:
        self.bind(dst, self._slots.pop(src, None))

    def groups(self, slots: list[int]) -> list[tuple[str | None, list[int]]]:
        """The indices into ``slots`` of each adapter's sequences (None: the base model),
        the group of the adapter applied now first."""
        if not self._slots:
            return [(None, list(range(len(slots))))]
        groups: dict[str | None, list[int]] = {}
        for i, slot in enumerate(slots):
            groups.setdefault(self._slots.get(slot), []).append(i)
        return sorted(groups.items(), key=lambda g: g[0] != self._applied)

    def apply(self, name: str | None, ctx: Any) -> None:
        """Set adapter ``name`` (None: none) on ``ctx`` for the decodes that follow."""
        if name == self._applied:
            return
        ll = self._ll
        if name is None:
            rc = ll.llama_set_adapters_lora(ctx, None, 0, None)
        else:
            handles = (ll.llama_adapter_lora_p_ctypes * 1)(self._handles[name])
            rc = ll.llama_set_adapters_lora(ctx, handles, 1, (ctypes.c_float * 1)(1.0))
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not set the LoRA adapter {name!r} ({rc})")
        self._applied = name
