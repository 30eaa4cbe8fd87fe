"""The deployment manifest: TOML in, validated attrs objects out.

Every problem names its key path (``models[0].max_seq_len``) and says what to do; the CLI
prints it and exits with status 2.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from laya_core.backend import ModelConfig
from laya_core.manifest_table import ManifestError, Table, non_empty, parse_size
from laya_core.model_files import model_file_problem
from laya_core.router import POLICIES
from laya_core.server_manifest import ServerConfig, check_host_resolves, parse_server

__all__ = ["EMBEDDED_MODEL", "KV_CACHE_DTYPES", "Manifest", "ManifestError", "MemoryConfig",
           "RouterConfig", "ServerConfig", "default_manifest", "from_dict", "load",
           "parse_size", "resolve"]

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the brief names
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for tools that read this file
    import tomli as tomllib

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@attrs.frozen
class MemoryConfig:
    budget_bytes: int | None = None  # None: "auto", decided from the machine


@attrs.frozen
class RouterConfig:
    impl: str | None = None  # None: "cpp" when installed, else "python"


@attrs.frozen
class Manifest:
    server: ServerConfig
    memory: MemoryConfig
    router: RouterConfig
    models: tuple[ModelConfig, ...]
    source: str = "<default>"


def _memory(data: Any) -> MemoryConfig:
    t = Table(data, "memory")
    budget = t.get("budget", (str, int), "auto")
    t.finish(("budget",))
    if budget == "auto":
        return MemoryConfig(None)
    return MemoryConfig(parse_size(budget, "memory.budget", minimum=2**20))


def _router(data: Any) -> RouterConfig:
    t = Table(data, "router")
    impl = t.get("impl", str)
    t.finish(("impl",))
    return RouterConfig(impl)


_MODEL_KEYS = ("name", "backend", "path", "max_seq_len", "max_num_seqs", "kv_cache_tokens",
               "kv_cache_dtype", "prefix_caching", "routing", "replicas", "max_step_tokens", "max_queue", "queue_timeout_s",
               "scheduler", "cache_policy", "options")
KV_CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def _model(data: Any, index: int, base_dir: Path) -> ModelConfig:
    t = Table(data, f"models[{index}]")
    name = t.get("name", str, required=True,
                 check=lambda v: None if _NAME_RE.match(v) else
                 "use 1-128 letters, digits and . _ : / - (starting with a letter or digit)")
    backend = t.get("backend", str, "llamacpp", check=non_empty)
    path = t.get("path", str, required=True, check=non_empty)
    if not path.startswith("embedded:"):
        p = Path(path).expanduser()
        path = str(p if p.is_absolute() else (base_dir / p))
    max_seq_len = t.int_in("max_seq_len", 16, 1 << 20, None)
    max_num_seqs = t.int_in("max_num_seqs", 1, 256, None)
    kv_cache_tokens = t.int_in("kv_cache_tokens", 16, 1 << 30, None)
    if kv_cache_tokens is not None and max_seq_len is not None and kv_cache_tokens < max_seq_len:
        raise ManifestError(t.key("kv_cache_tokens"),
                            f"{kv_cache_tokens} tokens cannot hold one sequence of max_seq_len "
                            f"{max_seq_len}; raise it or lower max_seq_len")
    kv_cache_dtype = t.get("kv_cache_dtype", str, "f16",
                           check=lambda v: None if v in KV_CACHE_DTYPES else
                           f"must be one of {', '.join(KV_CACHE_DTYPES)}")
    prefix_caching = t.get("prefix_caching", bool, True)
    routing = t.get("routing", str, "prefix",
                    check=lambda v: None if v in POLICIES else
                    f"must be one of {', '.join(POLICIES)}")
    replicas = t.int_in("replicas", 1, 64, 1)
    max_step_tokens = t.int_in("max_step_tokens", 1, 65536, 512)
    max_queue = t.int_in("max_queue", 0, 100_000, 64)
    queue_timeout_s = t.get("queue_timeout_s", (int, float), 30.0,
                            check=lambda v: None if 0 < v <= 3600 else
                            "must be between 0 and 3600 seconds")
    if max_num_seqs is not None and max_step_tokens < max_num_seqs:
        raise ManifestError(t.key("max_step_tokens"),
                            f"must be at least max_num_seqs ({max_num_seqs}) so every running "
                            "sequence can decode each step")
    scheduler = t.get("scheduler", str, "fcfs", check=non_empty)
    cache_policy = t.get("cache_policy", str, "blocks", check=non_empty)
    options = dict(t.get("options", dict, {}))
    t.finish(_MODEL_KEYS)
    return ModelConfig(name, backend, path, max_seq_len, max_num_seqs, replicas,
                       max_step_tokens, scheduler, cache_policy, kv_cache_tokens,
                       kv_cache_dtype, prefix_caching, routing, max_queue,
                       float(queue_timeout_s), options)


def from_dict(data: Mapping[str, Any], source: str = "<dict>",
              base_dir: Path | None = None) -> Manifest:
    """Validate a manifest already parsed from TOML. Paths are relative to ``base_dir``."""
    t = Table(data, "")
    server = parse_server(t.get("server", dict, {}))
    memory = _memory(t.get("memory", dict, {}))
    router = _router(t.get("router", dict, {}))
    raw_models = t.get("models", list, required=True)
    t.finish(("server", "memory", "router", "models"))
    if not raw_models:
        raise ManifestError("models", "list at least one [[models]] entry")
    models = tuple(_model(m, i, base_dir or Path.cwd()) for i, m in enumerate(raw_models))
    seen: dict[str, int] = {}
    for i, m in enumerate(models):
        if m.name in seen:
            raise ManifestError(f"models[{i}].name",
                                f"{m.name!r} is already the name of models[{seen[m.name]}]")
        seen[m.name] = i
    return Manifest(server, memory, router, models, source)


def load(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ManifestError("", f"cannot read manifest {p}: {e.strerror or e}") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError("", f"{p} is not valid TOML: {e}") from e
    return from_dict(data, str(p), p.resolve().parent)


def default_manifest(host: str = "127.0.0.1", port: int = 8000) -> Manifest:
    """What ``laya serve`` runs with no manifest: the embedded model, safe defaults."""
    model = ModelConfig(name="smollm2", backend="llamacpp", path=EMBEDDED_MODEL)
    return Manifest(ServerConfig(host, port), MemoryConfig(), RouterConfig(), (model,))


def resolve(manifest: Manifest, registry: Any, *, need_backends: bool = True) -> Manifest:
    """Check backends, schedulers and routers against the loaded plugins and find model files.

    ``registry`` is a :class:`laya_core.plugins.Registry`. Returns the manifest with every model
    path resolved to a file. ``need_backends=False`` lets a plan be made for a backend that is
    not installed here.
    """
    if need_backends:
        check_host_resolves(manifest.server.host)
    if manifest.router.impl is not None and manifest.router.impl not in registry.routers:
        known = ", ".join(sorted(registry.routers))
        raise ManifestError("router.impl",
                            f"no router {manifest.router.impl!r} is installed; known: {known}")
    models = []
    for i, m in enumerate(manifest.models):
        for key, family in (("backend", registry.backends), ("scheduler", registry.schedulers),
                            ("cache_policy", registry.cache_policies)):
            chosen = getattr(m, key)
            if key == "backend" and not need_backends:
                continue
            if chosen not in family:
                known = ", ".join(sorted(family)) or "none"
                raise ManifestError(f"models[{i}].{key}",
                                    f"no {key.replace('_', ' ')} {chosen!r} is installed "
                                    f"(installed: {known}); install its plugin or fix the name")
        backend = registry.backends.get(m.backend)
        if backend and m.kv_cache_dtype not in backend.obj.kv_cache_dtypes:
            raise ManifestError(f"models[{i}].kv_cache_dtype",
                                f"the {m.backend} backend cannot store a {m.kv_cache_dtype} KV "
                                f"cache; it supports {', '.join(backend.obj.kv_cache_dtypes)}")
        try:
            resolved = registry.resolve_model_path(m.path)
        except LookupError as e:
            raise ManifestError(f"models[{i}].path", str(e)) from e
        path = resolved or m.path
        if problem := model_file_problem(path):
            raise ManifestError(f"models[{i}].path", problem)
        if backend and need_backends:
            _check_backend_fit(backend.obj, m, path, i)
        models.append(attrs.evolve(m, path=path))
    return attrs.evolve(manifest, models=tuple(models))


def _check_backend_fit(backend_cls: Any, m: ModelConfig, path: str, i: int) -> None:
    """The model file and the options suit the chosen backend."""
    problem = backend_cls.check_model_path(path)
    if problem:
        raise ManifestError(f"models[{i}].path", problem)
    for name in m.options:
        if name not in backend_cls.option_names:
            known = ", ".join(sorted(backend_cls.option_names)) or "none"
            raise ManifestError(f"models[{i}].options.{name}",
                                f"the {m.backend} backend has no option {name!r}; its "
                                f"options are: {known}")
        problem = backend_cls.check_option(name, m.options[name])
        if problem:
            raise ManifestError(f"models[{i}].options.{name}", problem)
