"""The deployment manifest: TOML in, validated attrs objects out.

Every problem names its key path (``models[0].max_seq_len``) and says what to do; the CLI
prints it and exits with status 2.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from laya_core import budget
from laya_core.backend import ModelConfig
from laya_core.model_files import model_file_problem
from laya_core.router import POLICIES

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the brief names
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for tools that read this file
    import tomli as tomllib

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
MAX_KEY_FILE_BYTES = 2**20
_HOSTNAME_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


class ManifestError(Exception):
    """A manifest problem; ``key`` is the path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout_s: float = 30.0  # in-flight requests may finish this long after SIGTERM
    body_timeout_s: float = 30.0  # a request body must arrive whole within this long


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


def parse_size(text: str | int, key: str, minimum: int = 1) -> int:
    """A size in whole bytes (:func:`laya_core.budget.parse_size`); errors name ``key``."""
    try:
        return budget.parse_size(text, minimum)
    except ValueError as e:
        raise ManifestError(key, str(e)) from None


class _Table:
    """Reads typed keys from one TOML table and complains about the ones left over."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ManifestError(path, f"expected a table, got {type(data).__name__}")
        self.data = dict(data)
        self.path = path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None,
            required: bool = False, check: Callable[[Any], str | None] | None = None) -> Any:
        if name not in self.data:
            if required:
                raise ManifestError(self.key(name), "is required")
            return default
        value = self.data.pop(name)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ManifestError(self.key(name), f"expected {names}, got {value!r}")
        problem = check(value) if check else None
        if problem:
            raise ManifestError(self.key(name), problem)
        return value

    def int_in(self, name: str, low: int, high: int, default: int | None) -> Any:
        def check(v: int) -> str | None:
            return None if low <= v <= high else f"must be between {low} and {high}, got {v}"
        return self.get(name, int, default, check=check)

    def finish(self, known: tuple[str, ...]) -> None:
        for name in self.data:
            hint = f"; known keys: {', '.join(known)}" if known else ""
            raise ManifestError(self.key(name), f"unknown key{hint}")


def _non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _host_problem(host: str) -> str | None:
    if re.fullmatch(r"[\d.]+", host) or ":" in host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return f"{host!r} is not a valid IP address (give an address or a name, no port)"
    elif len(host) > 253 or not _HOSTNAME_RE.match(host):
        return f"{host!r} is neither an IP address nor a valid host name"
    return None


def _key_problem(key: object) -> str | None:
    """The rule every API key follows, wherever it comes from."""
    if not isinstance(key, str) or len(key) < 8:
        return "an API key is a string of 8+ characters"
    return None if key.isprintable() else "an API key may not hold control characters"


def _read_key_file(name: str) -> list[str]:
    """Keys one a line, stripped; blank lines and lines starting with # are skipped."""
    path = Path(name).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO must not wait
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ManifestError("server.api_keys_file", f"{path} is not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_KEY_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise ManifestError("server.api_keys_file", f"cannot read {path}: {e.strerror}") from e
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ManifestError("server.api_keys_file", f"{path} is larger than 1 MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError("server.api_keys_file",
                            f"{path} is not UTF-8 text (byte {e.start} is invalid); it must "
                            "hold one key a line") from None
    keys = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    keys = [(n, k) for n, k in keys if k and not k.startswith("#")]
    for n, k in keys:
        if problem := _key_problem(k):
            raise ManifestError("server.api_keys_file", f"line {n} of {path}: {problem}")
    return [k for _, k in keys]


def _api_keys(t: _Table) -> list[str]:
    keys = list(t.get("api_keys", list, []))
    for i, k in enumerate(keys):
        if problem := _key_problem(k):
            raise ManifestError(f"server.api_keys[{i}]", problem)
    env = t.get("api_keys_env", str)
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise ManifestError("server.api_keys_env", f"environment variable {env} is not set")
        env_keys = [k.strip() for k in value.split(",") if k.strip()]
        for i, k in enumerate(env_keys):
            if problem := _key_problem(k):
                raise ManifestError("server.api_keys_env", f"key {i + 1} in {env}: {problem}")
        keys += env_keys
    key_file = t.get("api_keys_file", str)
    return keys + (_read_key_file(key_file) if key_file is not None else [])


def _server(data: Any) -> ServerConfig:
    t = _Table(data, "server")
    host = t.get("host", str, "127.0.0.1",
                 check=lambda v: _non_empty(v) or _host_problem(v))
    port = t.int_in("port", 0, 65535, 8000)
    keys = _api_keys(t)
    body = t.get("max_body_bytes", (int, str), 4 * 2**20)
    shutdown = t.get("shutdown_timeout_s", (int, float), 30.0,
                     check=lambda v: None if 0 <= v <= 3600 else "must be 0 to 3600 seconds")
    body_timeout = t.get("body_timeout_s", (int, float), 30.0,
                         check=lambda v: None if 0.1 <= v <= 3600 else "must be 0.1 to 3600 seconds")
    t.finish(("host", "port", "api_keys", "api_keys_env", "api_keys_file", "max_body_bytes",
              "shutdown_timeout_s", "body_timeout_s"))
    return ServerConfig(host, port, tuple(keys),
                        parse_size(body, "server.max_body_bytes", minimum=1024), float(shutdown),
                        float(body_timeout))


def _memory(data: Any) -> MemoryConfig:
    t = _Table(data, "memory")
    budget = t.get("budget", (str, int), "auto")
    t.finish(("budget",))
    if budget == "auto":
        return MemoryConfig(None)
    return MemoryConfig(parse_size(budget, "memory.budget", minimum=2**20))


def _router(data: Any) -> RouterConfig:
    t = _Table(data, "router")
    impl = t.get("impl", str)
    t.finish(("impl",))
    return RouterConfig(impl)


_MODEL_KEYS = ("name", "backend", "path", "max_seq_len", "max_num_seqs", "kv_cache_tokens",
               "kv_cache_dtype", "prefix_caching", "routing", "replicas", "max_step_tokens", "max_queue", "queue_timeout_s",
               "scheduler", "cache_policy", "options")
KV_CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def _model(data: Any, index: int, base_dir: Path) -> ModelConfig:
    t = _Table(data, f"models[{index}]")
    name = t.get("name", str, required=True,
                 check=lambda v: None if _NAME_RE.match(v) else
                 "use 1-128 letters, digits and . _ : / - (starting with a letter or digit)")
    backend = t.get("backend", str, "llamacpp", check=_non_empty)
    path = t.get("path", str, required=True, check=_non_empty)
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
    scheduler = t.get("scheduler", str, "fcfs", check=_non_empty)
    cache_policy = t.get("cache_policy", str, "blocks", check=_non_empty)
    options = dict(t.get("options", dict, {}))
    t.finish(_MODEL_KEYS)
    return ModelConfig(name, backend, path, max_seq_len, max_num_seqs, replicas,
                       max_step_tokens, scheduler, cache_policy, kv_cache_tokens,
                       kv_cache_dtype, prefix_caching, routing, max_queue,
                       float(queue_timeout_s), options)


def from_dict(data: Mapping[str, Any], source: str = "<dict>",
              base_dir: Path | None = None) -> Manifest:
    """Validate a manifest already parsed from TOML. Paths are relative to ``base_dir``."""
    t = _Table(data, "")
    server = _server(t.get("server", dict, {}))
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
        _check_host_resolves(manifest.server.host)
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


def _check_host_resolves(host: str) -> None:
    """The host is an IP address or a name the local resolver knows (as serve will bind it)."""
    problem = _host_problem(host)
    numeric = socket.AI_NUMERICHOST if ":" in host or re.fullmatch(r"[\d.]+", host) else 0
    try:
        if not problem:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=numeric)
    except (OSError, UnicodeError) as e:
        problem = (f"{host!r} does not resolve on this machine ({getattr(e, 'strerror', e)}); "
                   "give an IP address such as 127.0.0.1 or 0.0.0.0, or a known host name")
    if problem:
        raise ManifestError("server.host", problem)


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
