"""The pytest plugin of the conformance suite: its options and the replica under test."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.memory import planner
from laya_core.plugins import Registry, load_registry
from laya_core.replica.client import EngineClient
from laya_core.serving.deployment import Deployment

# Small enough that prompts are prefilled in several chunks, and that a few sequences fill
# the pool: both are what the suite checks.
MAX_SEQ_LEN = 256
MAX_NUM_SEQS = 4
MAX_STEP_TOKENS = 32


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("laya", "Laya backend conformance")
    group.addoption("--laya-backend", help="the backend's registered name")
    group.addoption("--laya-model", help="a model file or embedded:NAME it serves")
    group.addoption("--laya-options", default="{}",
                    help="its [models.options] as a JSON object")
    group.addoption("--laya-plugin", action="append", default=[],
                    help="MODULE:ATTR of a plugin object to register (repeatable)")


def _plugin(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


@pytest.fixture(scope="session")
def laya_registry(request: pytest.FixtureRequest) -> Registry:
    return load_registry([_plugin(p) for p in request.config.getoption("--laya-plugin")])


@pytest.fixture(scope="session")
def laya_model(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``[[models]]`` entry under test."""
    backend = request.config.getoption("--laya-backend")
    path = request.config.getoption("--laya-model")
    if not backend or not path:
        raise pytest.UsageError("the conformance suite needs --laya-backend and --laya-model")
    return {"name": "under-test", "backend": backend, "path": path,
            "max_seq_len": MAX_SEQ_LEN, "max_num_seqs": MAX_NUM_SEQS,
            "max_step_tokens": MAX_STEP_TOKENS,
            "options": json.loads(request.config.getoption("--laya-options"))}


@pytest.fixture(scope="session")
def laya_deployment(laya_registry: Registry,
                    laya_model: dict[str, Any]) -> Iterator[Deployment]:
    manifest = mf.resolve(mf.from_dict({"models": [laya_model]}), laya_registry)
    plan = planner.make_plan(manifest, laya_registry)  # as laya serve starts a replica
    deployment = Deployment(planner.decided_manifest(manifest, plan), laya_registry, plan)
    rss_before[0] = rss()
    deployment.start()
    if not deployment.wait_ready(300):
        error = deployment.clients[0].state().error
        deployment.stop()
        pytest.fail(f"the replica did not load: {error}")
    yield deployment
    deployment.stop()


rss_before = [0]  # the process's RSS before the replica under test started


def rss() -> int:
    """This process's resident memory, bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(scope="session")
def laya_rss_growth(laya_deployment: Deployment) -> int:
    """How much the process's RSS grew since just before the replica started."""
    return rss() - rss_before[0]


@pytest.fixture(scope="session")
def laya_engine(laya_deployment: Deployment) -> Engine:
    """The replica's engine; a check that needs it is a step-level backend's alone, and is
    skipped, saying so, for an engine-level one (``kind = "engine"``)."""
    if not laya_deployment.engines:
        (config,) = laya_deployment.models.values()
        pytest.skip(f"a step-level check: the {config.backend} backend is engine-level, so "
                    "the core's engine, scheduler and KV pool it checks do not run")
    return laya_deployment.engines[0]


@pytest.fixture(scope="session")
def laya_speculative_engine(laya_registry: Registry, laya_model: dict[str, Any],
                            laya_engine: Engine) -> Iterator[Engine]:
    """A second replica of the model under test with speculative decoding on (prompt
    lookup), for a backend that says ``supports_speculative``; skipped, saying so, for one
    that does not (a backend is not required to verify drafts)."""
    if not type(laya_engine.backend).supports_speculative:
        pytest.skip(f"the {laya_model['backend']} backend does not verify drafts "
                    "(supports_speculative is False)")
    yield from _replica_of(laya_registry, {
        **laya_model, "name": "under-test-speculative",
        "speculative": {"method": "ngram", "num_speculative_tokens": 4}}, "with drafts")


def _replica_of(registry: Registry, model: dict[str, Any], what: str) -> Iterator[Engine]:
    """A replica of ``model`` (a [[models]] entry), loaded, while the fixture lasts."""
    deployment = Deployment(mf.resolve(mf.from_dict({"models": [model]}), registry), registry)
    deployment.start()
    if not deployment.wait_ready(300):
        error = deployment.clients[0].state().error
        deployment.stop()
        pytest.fail(f"the replica {what} did not load: {error}")
    yield deployment.engines[0]
    deployment.stop()


@pytest.fixture(scope="session")
def laya_lora_engine(laya_registry: Registry, laya_model: dict[str, Any], laya_engine: Engine,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A second replica of the model under test with three LoRA adapters of random
    matrices (laya_core/testing/adapters.py), in the backend's ``lora_format``: ``a`` and
    ``b``, and ``zero``, ``a``'s A matrices with B = 0; for a backend that says
    ``supports_lora``, and skipped, saying so, for one that does not (a backend is not
    required to apply adapters)."""
    from laya_core.testing.adapters import random_adapter

    backend = type(laya_engine.backend)
    if not backend.supports_lora:
        pytest.skip(f"the {laya_model['backend']} backend does not apply LoRA adapters "
                    "(supports_lora is False)")
    shape = backend.model_shape(laya_engine.config.path)
    folder = tmp_path_factory.mktemp("laya-lora")
    fmt = backend.lora_format
    lora = {"a": random_adapter(folder / "a", shape, seed=1, fmt=fmt),
            "b": random_adapter(folder / "b", shape, seed=2, fmt=fmt),
            "zero": random_adapter(folder / "zero", shape, seed=1, zero=True, fmt=fmt)}
    yield from _replica_of(laya_registry, {
        **laya_model, "name": "under-test-lora",
        "lora": {name: str(path) for name, path in lora.items()}}, "with adapters")


@pytest.fixture(scope="session")
def laya_client(laya_deployment: Deployment) -> EngineClient:
    """The replica as the HTTP side sees it, whichever kind of backend serves it."""
    return laya_deployment.clients[0]
