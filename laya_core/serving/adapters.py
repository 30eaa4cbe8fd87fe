"""The LoRA adapters a deployment serves: which model each adapts, each model's table of
adapters now (its manifest's ``lora`` and those loaded while serving), and the loads and
unloads of ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on every replica
of a model.

The maps are replaced whole, never changed in place: the HTTP side reads them from the event
loop while a model found while serving is added on another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import attrs

from laya_core.backend import ModelConfig
from laya_core.models.checks import ModelFileError
from laya_core.models.lora import AdapterError, rank_limit
from laya_core.plugins import Registry
from laya_core.replica.client import EngineClient
from laya_core.replica.remote import RemoteEngineClient


class AdapterRoomError(ValueError):
    """The plan holds room for no more LoRA adapters on the model (its max_loras)."""


class Adapters:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        # An adapter's name -> the model it adapts: a request naming the adapter runs on
        # that model, with it.
        self.parents: dict[str, str] = {}
        # Each model's adapters now, name -> path: a replica loads these when it starts.
        self.tables: dict[str, dict[str, str]] = {}

    def add_model(self, config: ModelConfig) -> None:
        self.tables = {**self.tables, config.name: dict(config.lora)}
        self.parents = {**self.parents, **{name: config.name for name in config.lora}}

    def of(self, model: str) -> dict[str, str]:
        """``model``'s adapters now, name -> path."""
        return self.tables[model]

    def check(self, config: ModelConfig, path: str) -> None:
        """Whether the adapter at ``path`` may be loaded on ``config``'s model now: an
        adapter of its shape in its backend's format (else AdapterError), of a rank the plan
        holds room for (``max_lora_rank``), with fewer than ``max_loras`` loaded (else
        AdapterRoomError). Reads headers only."""
        backend = self.registry.backends[config.backend].obj
        try:
            shape = backend.model_shape(config.path)
        except (ModelFileError, OSError, ValueError) as e:
            raise AdapterError(f"the model's shape could not be read: {e}") from None
        adapter = backend.read_adapter(path, shape)
        limit = rank_limit(config.max_lora_rank,
                           [backend.read_adapter(p, None).rank for p in config.lora.values()])
        if adapter.rank > limit:
            raise AdapterError(f"the adapter's rank {adapter.rank} is above max_lora_rank "
                               f"({limit}), which the memory plan holds room for")
        loaded = sum(1 for m in self.parents.values() if m == config.name)
        if loaded >= config.lora_slots:
            raise AdapterRoomError(f"{loaded} adapters are loaded on {config.name!r}, its "
                                   "max_loras; unload one first")

    async def load(self, clients: Sequence[EngineClient], model: str, name: str,
                   path: str) -> None:
        """Load adapter ``name`` on every one of ``model``'s replicas (``clients``; all or
        none), then route requests naming it there. A worker that restarts loads it again
        (its config says it), and so do the replicas of an on-demand model's later loads.
        The caller has checked the adapter and the plan's room, and holds an on-demand
        model loaded."""
        done: list[EngineClient] = []
        try:
            for client in clients:
                await client.adapter("load", name, path)
                done.append(client)
        except BaseException:
            for client in done:
                with contextlib.suppress(Exception):
                    await client.adapter("unload", name)
            raise
        for client in done:
            _note(client, name, path)
        self.tables = {**self.tables, model: {**self.tables[model], name: path}}
        self.parents = {**self.parents, name: model}

    async def unload(self, name: str, clients: Sequence[EngineClient] | None) -> None:
        """Stop routing requests to adapter ``name``, and unload it from its model's
        replicas (``clients``) once the requests using it there have finished; None: its
        model is an on-demand one that is not loaded (nor loading), whose next load leaves
        it out."""
        model = self.parents[name]
        self.parents = {k: v for k, v in self.parents.items() if k != name}
        self.tables = {**self.tables, model: {
            k: v for k, v in self.tables[model].items() if k != name}}
        if clients is None:
            return
        for client in clients:
            _note(client, name, None)
        await asyncio.gather(*(c.adapter("unload", name) for c in clients))


def _note(client: EngineClient, name: str, path: str | None) -> None:
    """Keep a worker's config in step with the adapters loaded while serving (``path``
    None: unloaded), so that a restarted worker loads them again."""
    if isinstance(client, RemoteEngineClient):
        lora = {k: v for k, v in client.config.lora.items() if k != name}
        if path is not None:
            lora[name] = path
        client.config = attrs.evolve(client.config, lora=lora)
