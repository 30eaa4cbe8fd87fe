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
from laya_core.config import models_dir as models_dir_mod
from laya_core.config.model_plugins import (
    AUTO_BACKEND,
    SCHEME_RE,
    default_backend,
    resolve_model,
)
from laya_core.config.models_dir import ModelsDir
from laya_core.config.server import (
    SERVER_KEYS,
    ServerConfig,
    check_host_resolves,
    parse_server,
)
from laya_core.config.table import (
    ManifestError,
    Problems,
    Table,
    non_empty,
    parse_size,
)
from laya_core.memory import devices
from laya_core.models.lora import MAX_RANK
from laya_core.replica.worker_link import DEFAULT_SILENCE_S
from laya_core.routing.router import POLICIES
from laya_core.structured.reasoning import REASONING_FORMATS
from laya_core.structured.tool_formats import FORMATS as TOOL_FORMATS
from laya_core.types import AUTO_SPECULATIVE, SpeculativeConfig

__all__ = ["AUTO_BACKEND", "CLUSTER_KEYS", "EMBEDDED_MODEL", "ENGINE_KINDS",
           "MEMORY_KEYS", "MODEL_KEYS", "ROUTER_KEYS", "SERVER_KEYS", "TOP_KEYS",
           "ClusterConfig", "Manifest", "ManifestError", "MemoryConfig", "RouterConfig",
           "ServerConfig", "build", "default_backend", "default_manifest",
           "from_dict", "load", "parse_size", "read_toml", "resolve"]

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the brief names
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for tools that read this file
    import tomli as tomllib

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@attrs.frozen
class MemoryConfig:
    budget_bytes: int | None = None  # None: "auto", decided from the machine
    # Each GPU's budget: one size for all, or sizes by device ("cuda:0"); None: "auto",
    # what each has free less headroom (laya_core/memory/devices.py).
    gpu_budget: int | dict[str, int] | None = None


@attrs.frozen
class RouterConfig:
    impl: str | None = None  # None: "cpp" when installed, else "python"


ENGINE_KINDS = ("auto", "process", "thread", "ray")


@attrs.frozen
class ClusterConfig:
    """Where replicas run: "process", a worker process each (``laya serve``'s default, as
    "auto" is there); "thread", threads of the server's own process (a backend crash takes
    the server down); "auto", whatever the caller chose (laya_core/serving/deployment.py); "ray", a
    Ray actor each, placed on a cluster's nodes by the memory plan (laya_core/replica/ray_client.py).
    ``address``: the Ray cluster to join (else RAY_ADDRESS, else a local one).
    ``worker_timeout_s``: a worker process that sends nothing this long (no step, no
    heartbeat) is killed and restarted (laya_core/replica/worker_link.py); threads and Ray actors
    do not use it."""

    engine: str = "auto"
    address: str | None = None
    worker_timeout_s: float = DEFAULT_SILENCE_S


@attrs.frozen
class Manifest:
    server: ServerConfig
    memory: MemoryConfig
    router: RouterConfig
    models: tuple[ModelConfig, ...]
    source: str = "<default>"
    # Each model's index among the file's [[models]] (for key paths in messages).
    model_index: Mapping[str, int] = attrs.field(factory=dict, eq=False)
    cluster: ClusterConfig = ClusterConfig()
    # [models_dir]: a folder whose models are served on demand, found again while serving.
    models_dir: ModelsDir | None = None
    from_dir: frozenset[str] = frozenset()  # the models found in it (not [[models]] entries)


MEMORY_KEYS = ("budget", "gpu_budget")
ROUTER_KEYS = ("impl",)
CLUSTER_KEYS = ("engine", "address", "worker_timeout_s")
TOP_KEYS = ("server", "memory", "router", "cluster", "models", "models_dir")


def _cluster(data: Any, problems: Problems) -> ClusterConfig:
    t = Table(data, "cluster", problems)
    engine = t.get("engine", str, "auto", check=lambda v: None if v in ENGINE_KINDS else
                   f"must be one of {', '.join(ENGINE_KINDS)}, got {v!r}")
    address = t.get("address", str, None, check=lambda v: None if engine == "ray" else
                    f'applies only with engine = "ray" (engine is "{engine}")')
    timeout = t.get("worker_timeout_s", (int, float), DEFAULT_SILENCE_S, check=lambda v:
                    None if 1 <= v <= 3600 else "must be between 1 and 3600 seconds")
    t.finish(CLUSTER_KEYS)
    return ClusterConfig(engine, address, float(timeout))


def _memory(data: Any, problems: Problems) -> MemoryConfig:
    t = Table(data, "memory", problems)
    budget = t.get("budget", (str, int), "auto")
    gpu = t.get("gpu_budget", (str, int, dict), "auto")
    t.finish(MEMORY_KEYS)
    budget_bytes: int | None = None
    gpu_budget: int | dict[str, int] | None = None
    with problems.guard():
        if budget != "auto":
            budget_bytes = parse_size(budget, "memory.budget", minimum=2**20)
    if isinstance(gpu, dict):
        by_device: dict[str, int] = {}
        for device, size in gpu.items():
            key = f"memory.gpu_budget.{device}"
            if (problem := devices.check_device_name(device)) is not None:
                problems.add(key, problem)
                continue
            with problems.guard():
                by_device[device] = parse_size(size, key, minimum=2**20)
        gpu_budget = by_device
    elif gpu != "auto":
        with problems.guard():
            gpu_budget = parse_size(gpu, "memory.gpu_budget", minimum=2**20)
    return MemoryConfig(budget_bytes, gpu_budget)


def _router(data: Any, problems: Problems) -> RouterConfig:
    t = Table(data, "router", problems)
    impl = t.get("impl", str)
    t.finish(ROUTER_KEYS)
    return RouterConfig(impl)


# When a model's replicas load: with the server ("always"), or at its first request, to be
# unloaded when idle or when another needs the room ("on_demand", laya_core/serving/residency.py).
LOAD_MODES = ("always", "on_demand")

MODEL_KEYS = ("name", "backend", "path", "max_seq_len", "max_num_seqs", "kv_cache_tokens",
              "kv_cache_dtype", "prefix_caching", "routing", "replicas", "max_step_tokens",
              "max_queue", "queue_timeout_s", "scheduler", "cache_policy", "embeddings",
              "tool_call_format", "reasoning_format", "max_reasoning_tokens", "load",
              "idle_unload_s", "speculative", "lora", "max_loras", "max_lora_rank",
              "stream_interval_ms", "options")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min",
                    "prompt_lookup_max", "model", "disable_by_batch_size")
# Speculative decoding's methods: prompt lookup (laya_core/engine/speculative.py) and a
# draft model (laya_core/engine/draft_model.py).
SPECULATIVE_METHODS = ("ngram", "draft")


def _name_problem(v: str) -> str | None:
    return None if _NAME_RE.match(v) else \
        "use 1-128 letters, digits and . _ : / - (starting with a letter or digit)"


# A model path such as embedded:NAME, which a resolve_model_path plugin turns into a file.


def _speculative(data: Any, where: str, base_dir: Path,
                 problems: Problems) -> SpeculativeConfig:
    """A model's ``speculative`` table (absent: :data:`AUTO_SPECULATIVE`; false: off)."""
    t = Table(data, where, problems)
    method = t.get("method", str, "ngram", check=lambda v: None if v in SPECULATIVE_METHODS
                   else 'must be "ngram" (prompt lookup) or "draft" (a draft model)')
    model = t.get("model", str, None, check=lambda v: None if v else "must not be empty")
    if method == "draft" and model is None and "model" not in data:
        t.problem("model", 'is required with method = "draft": the draft model\'s path (a '
                  "smaller model of the same vocabulary, served by the same backend)")
    elif method == "ngram" and model is not None:
        t.problem("model", 'is only for method = "draft"')
    if model is not None and not SCHEME_RE.match(model):  # a file, not embedded:NAME
        p = Path(model).expanduser()
        model = str(p if p.is_absolute() else base_dir / p)
    default = SpeculativeConfig()
    k = t.int_in("num_speculative_tokens", 1, 32, default.num_speculative_tokens)
    low = t.int_in("prompt_lookup_min", 1, 32, default.prompt_lookup_min)
    high = t.int_in("prompt_lookup_max", 1, 32, default.prompt_lookup_max)
    if low is not None and high is not None and low > high:
        t.problem("prompt_lookup_max", f"must be at least prompt_lookup_min ({low}), got {high}")
    batch = t.int_in("disable_by_batch_size", 1, 4096, None)
    t.finish(SPECULATIVE_KEYS)
    # (a problem fails the manifest)
    return SpeculativeConfig(method, k, low, high, model, batch)


def _lora(data: dict[str, Any], where: str, base_dir: Path,
          problems: Problems) -> dict[str, str]:
    """A model's ``lora`` table: adapter name -> PEFT folder or GGUF LoRA file (relative to
    the manifest). The adapters are checked against the model in resolve()."""
    out = {}
    for name, path in data.items():
        key = f"{where}.{name}"
        if (problem := _name_problem(name)) is not None:
            problems.add(key, f"an adapter's name is what requests send as 'model': {problem}")
        elif not isinstance(path, str) or not path:
            problems.add(key, "must be the path of a LoRA adapter (a PEFT folder, or a GGUF "
                         f"file for llamacpp), got {path!r}")
        else:
            p = Path(path).expanduser()
            out[name] = str(p if p.is_absolute() else base_dir / p)
    return out


def _model(data: Any, index: int, base_dir: Path, problems: Problems) -> ModelConfig | None:
    """One ``[[models]]`` entry; None when it is too broken to check further."""
    t = Table(data, f"models[{index}]", problems)
    name = t.get("name", str, required=True, check=_name_problem)
    # "auto": chosen in resolve() from the installed backends (default_backend).
    backend = t.get("backend", str, AUTO_BACKEND, check=non_empty)
    path = t.get("path", str, required=True, check=non_empty)
    # SCHEME:NAME is a plugin's to say, and a URL (a backend without a local file) no path.
    if path is not None and not SCHEME_RE.match(path) and "://" not in path:
        p = Path(path).expanduser()
        path = str(p if p.is_absolute() else (base_dir / p))
    max_seq_len = t.int_in("max_seq_len", 16, 1 << 20, None)
    max_num_seqs = t.int_in("max_num_seqs", 1, 256, None)
    kv_cache_tokens = t.int_in("kv_cache_tokens", 16, 1 << 30, None)
    if kv_cache_tokens is not None and max_seq_len is not None and kv_cache_tokens < max_seq_len:
        t.problem("kv_cache_tokens", f"{kv_cache_tokens} tokens cannot hold one sequence of "
                  f"max_seq_len {max_seq_len}; raise it or lower max_seq_len")
    # Checked against the chosen backend's KV types in resolve(): each backend declares its own.
    kv_cache_dtype = t.get("kv_cache_dtype", str, "f16", check=non_empty)
    prefix_caching = t.get("prefix_caching", bool, True)
    # Checked against the chosen router's policies in resolve(): a router plugin may bring
    # its own.
    routing = t.get("routing", str, "prefix", check=non_empty)
    replicas = t.int_in("replicas", 1, 64, 1)
    max_step_tokens = t.int_in("max_step_tokens", 1, 65536, 512)
    max_queue = t.int_in("max_queue", 0, 100_000, 64)
    queue_timeout_s = t.get("queue_timeout_s", (int, float), 30.0,
                            check=lambda v: None if 0 < v <= 3600 else
                            "must be between 0 and 3600 seconds")
    if max_num_seqs is not None and max_step_tokens < max_num_seqs:
        t.problem("max_step_tokens", f"must be at least max_num_seqs ({max_num_seqs}) so every "
                  "running sequence can decode each step")
    scheduler = t.get("scheduler", str, "fcfs", check=non_empty)
    cache_policy = t.get("cache_policy", str, "auto", check=non_empty)
    options = dict(t.get("options", dict, {}))
    embeddings = t.get("embeddings", bool, False)
    tool_call_format = t.get("tool_call_format", str, "auto", check=lambda v: None
                             if v == "auto" or v in TOOL_FORMATS else
                             "must be auto or one of " + ", ".join(TOOL_FORMATS))
    reasoning_format = t.get("reasoning_format", str, "auto", check=lambda v: None
                             if v in REASONING_FORMATS else
                             "must be " + ", ".join(REASONING_FORMATS))
    max_reasoning_tokens = t.int_in("max_reasoning_tokens", 1, 1 << 30, None)
    load = t.get("load", str, "always", check=lambda v: None if v in LOAD_MODES else
                 "must be " + " or ".join(f'"{m}"' for m in LOAD_MODES))
    idle_unload_s = t.get("idle_unload_s", (int, float), None,
                          check=lambda v: None if 0 < v <= 30 * 86400 else
                          "must be between 0 and 2592000 seconds (30 days)")
    if idle_unload_s is not None and load != "on_demand":
        t.problem("idle_unload_s", 'applies to models loaded on demand: set load = '
                  '"on_demand" too, or remove it (a model loaded always stays loaded)')
    raw_speculative = t.get("speculative", (dict, bool), None)
    speculative: SpeculativeConfig | None = AUTO_SPECULATIVE  # absent: where it is exact
    if raw_speculative is False:
        speculative = None
    elif raw_speculative is True:
        speculative = SpeculativeConfig()
    elif raw_speculative is not None:
        speculative = _speculative(raw_speculative, t.key("speculative"), base_dir, problems)
    lora = _lora(t.get("lora", dict, {}), t.key("lora"), base_dir, problems)
    max_loras = t.int_in("max_loras", 0, 64, None)
    if max_loras is not None and max_loras < len(lora):
        t.problem("max_loras", f"must be at least the {len(lora)} adapters lora lists")
    max_lora_rank = t.int_in("max_lora_rank", 1, MAX_RANK, None)
    stream_interval_ms = t.get("stream_interval_ms", (int, float), 20.0,
                               check=lambda v: None if 0 <= v <= 1000 else
                               "must be between 0 and 1000 milliseconds")
    t.finish(MODEL_KEYS)
    if name is None or path is None:
        return None
    return ModelConfig(name, backend, path, max_seq_len, max_num_seqs, replicas,
                       max_step_tokens, scheduler, cache_policy, kv_cache_tokens,
                       kv_cache_dtype, prefix_caching, routing, max_queue,
                       float(queue_timeout_s), options, embeddings, tool_call_format,
                       load or "always",
                       None if idle_unload_s is None else float(idle_unload_s),
                       reasoning_format or "auto", max_reasoning_tokens, speculative,
                       lora, max_loras, max_lora_rank,
                       stream_interval_ms=float(stream_interval_ms))


def _from_dict(data: Mapping[str, Any], source: str, base_dir: Path,
               problems: Problems) -> Manifest:
    """Read every table, recording problems; broken model entries are left out."""
    t = Table(data, "", problems)
    server = parse_server(t.get("server", dict, {}), problems, base_dir)
    memory = _memory(t.get("memory", dict, {}), problems)
    router = _router(t.get("router", dict, {}), problems)
    cluster = _cluster(t.get("cluster", dict, {}), problems)
    raw_dir = t.get("models_dir", dict, None)
    raw_models = t.get("models", list, [] if raw_dir is not None else None,
                       required=raw_dir is None)
    t.finish(TOP_KEYS)
    if raw_models == [] and raw_dir is None:
        problems.add("models", "list at least one [[models]] entry, or a [models_dir]")
    models_dir = None
    if raw_dir is not None:
        models_dir = models_dir_mod.parse(
            raw_dir, base_dir, problems, MODEL_KEYS,
            lambda entry, found: _model(entry, 0, base_dir, found))
    models: list[ModelConfig] = []
    seen: dict[str, int] = {}
    explicit = len(raw_models or ())
    if models_dir is not None:  # after the [[models]] entries, which win a name
        names = frozenset(str(m.get("name")) for m in raw_models or () if isinstance(m, dict))
        raw_models = [*(raw_models or ()), *models_dir.entries(names)]
    from_dir: set[str] = set()
    for i, raw in enumerate(raw_models or ()):
        if i >= explicit:  # a models_dir file: its problems name the file
            found = Problems()
            m = _model(raw, i, base_dir, found)
            for _, message in found.found:
                problems.add("models_dir.path", f"{raw['path']}: {message}")
            if m is not None and not found.found:
                seen[m.name] = i
                models.append(m)
                from_dir.add(m.name)
            continue
        m = None
        with problems.guard():
            m = _model(raw, i, base_dir, problems)
        if m is None:
            continue
        if m.name in seen:
            problems.add(f"models[{i}].name",
                         f"{m.name!r} is already the name of models[{seen[m.name]}]")
            continue
        seen[m.name] = i
        models.append(m)
    _check_adapter_names(models, seen, problems)
    return Manifest(server, memory, router, tuple(models), source, seen, cluster, models_dir,
                    frozenset(from_dir))


def _check_adapter_names(models: list[ModelConfig], seen: dict[str, int],
                         problems: Problems) -> None:
    """A request's ``model`` names one model or one adapter: no adapter takes a model's name
    or another adapter's."""
    owner: dict[str, str] = {}
    for m in models:
        for name in m.lora:
            key = f"models[{seen[m.name]}].lora.{name}"
            if name in seen:
                problems.add(key, f"{name!r} is the name of models[{seen[name]}]; requests "
                             "could not tell the adapter from the model")
            elif name in owner:
                problems.add(key, f"{name!r} is already an adapter of {owner[name]!r}")
            owner.setdefault(name, m.name)


def from_dict(data: Mapping[str, Any], source: str = "<dict>",
              base_dir: Path | None = None) -> Manifest:
    """Validate a manifest already parsed from TOML. Paths are relative to ``base_dir``.

    Raises one :class:`ManifestError` holding every problem found."""
    problems = Problems()
    manifest = _from_dict(data, source, base_dir or Path.cwd(), problems)
    problems.raise_if_any()
    return manifest


def read_toml(path: str | Path) -> dict[str, Any]:
    """A manifest file's TOML, not yet validated."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError("", f"{p} is not a manifest: it is not UTF-8 text (byte {e.start} "
                            "is invalid)") from None
    except OSError as e:
        raise ManifestError("", f"cannot read manifest {p}: {e.strerror or e}") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError("", f"{p} is not a manifest: it is not valid TOML ({e})") from e


def load(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    p = Path(path)
    return from_dict(read_toml(p), str(p), p.resolve().parent)


def build(data: Mapping[str, Any], registry: Any, *, source: str = "<dict>",
          base_dir: Path | None = None, need_backends: bool = True) -> Manifest:
    """Validate and :func:`resolve` in one pass: one :class:`ManifestError` lists every problem
    of both, so a manifest's mistakes all show in one run."""
    problems = Problems()
    manifest = _from_dict(data, source, base_dir or Path.cwd(), problems)
    manifest = _resolve(manifest, registry, need_backends, problems)
    problems.raise_if_any()
    return manifest


def default_manifest(host: str = "127.0.0.1", port: int = 8000) -> Manifest:
    """What ``laya serve`` runs with no manifest: the embedded model, safe defaults."""
    model = ModelConfig(name="smollm2", backend=AUTO_BACKEND, path=EMBEDDED_MODEL)
    return Manifest(ServerConfig(host, port), MemoryConfig(), RouterConfig(), (model,))


def resolve(manifest: Manifest, registry: Any, *, need_backends: bool = True) -> Manifest:
    """Check backends, schedulers and routers against the loaded plugins and find model files.

    ``registry`` is a :class:`laya_core.plugins.Registry`. Returns the manifest with every model
    path resolved to a file. ``need_backends=False`` lets a plan be made for a backend that is
    not installed here. Raises one :class:`ManifestError` holding every problem.
    """
    problems = Problems()
    manifest = _resolve(manifest, registry, need_backends, problems)
    problems.raise_if_any()
    return manifest


def _resolve(manifest: Manifest, registry: Any, need_backends: bool,
             problems: Problems) -> Manifest:
    if need_backends:
        with problems.guard():
            check_host_resolves(manifest.server.host)
    policies: tuple[str, ...] = ()
    if manifest.router.impl is not None and manifest.router.impl not in registry.routers:
        known = ", ".join(sorted(registry.routers))
        problems.add("router.impl",
                     f"no router {manifest.router.impl!r} is installed; known: {known}")
    else:
        router = registry.router_name(manifest.router.impl)
        policies = tuple(getattr(registry.routers[router].obj, "policies", POLICIES))
    models = []
    for i, m in enumerate(manifest.models):
        index = _index_of(manifest, m, i)
        if policies and m.routing not in policies:
            problems.add(f"models[{index}].routing",
                         f"must be one of {', '.join(policies)} (the policies of the "
                         f"{registry.router_name(manifest.router.impl)} router), not "
                         f"{m.routing!r}")
        if m.name in manifest.from_dir:  # its problems name the file, under models_dir
            found = Problems()
            with found.guard():
                resolved = resolve_model(m, index, registry, need_backends, found)
            for _, message in found.found:
                problems.add("models_dir.path", f"{m.path}: {message}")
            if not found.found:
                models.append(resolved)
            continue
        with problems.guard():
            models.append(resolve_model(m, index, registry, need_backends, problems))
    return attrs.evolve(manifest, models=tuple(models))


def _index_of(manifest: Manifest, m: ModelConfig, position: int) -> int:
    """A model's index in the file (broken entries before it were left out)."""
    return manifest.model_index.get(m.name, position)
