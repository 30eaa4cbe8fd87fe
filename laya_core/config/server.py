"""The manifest's ``[server]`` table: where to listen, API keys, body and shutdown limits."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import attrs

from laya_core.config.table import ManifestError, Problems, Table, non_empty, parse_size

MAX_KEY_FILE_BYTES = 2**20
_HOSTNAME_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout_s: float = 30.0  # in-flight requests may finish this long after SIGTERM
    body_timeout_s: float = 30.0  # a request body must arrive whole within this long
    access_log: bool = True  # one log line per request
    # Origins a browser may call from (CORS); () is off, ("*",) is any origin.
    cors_origins: tuple[str, ...] = ()
    # With API keys set, /metrics needs one too unless this is false (a Prometheus scraper
    # on a private network may not hold a key).
    metrics_need_api_key: bool = True
    # Host names (or addresses) requests may name in Host besides the server's own and
    # localhost's: a DNS-rebinding defence (laya_core/http/hosts.py). "*" is any host,
    # ".example.com" that domain and its subdomains.
    allowed_hosts: tuple[str, ...] = ()


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


def _read_key_file(name: str, base_dir: Path) -> list[str]:
    """Keys one a line, stripped; blank lines and lines starting with # are skipped. A
    relative path is the manifest folder's, as every path of a manifest is."""
    path = Path(name).expanduser()
    path = path if path.is_absolute() else base_dir / path
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


def _env_keys(env: str) -> list[str]:
    value = os.environ.get(env)
    if not value:
        raise ManifestError("server.api_keys_env", f"environment variable {env} is not set")
    keys = [k.strip() for k in value.split(",") if k.strip()]
    for i, k in enumerate(keys):
        if problem := _key_problem(k):
            raise ManifestError("server.api_keys_env", f"key {i + 1} in {env}: {problem}")
    return keys


def _api_keys(t: Table, base_dir: Path) -> list[str]:
    keys = []
    for i, k in enumerate(t.get("api_keys", list, [])):
        if problem := _key_problem(k):
            t.problem(f"api_keys[{i}]", problem)
        else:
            keys.append(k)
    env = t.get("api_keys_env", str)
    if env is not None:
        with t.problems.guard():
            keys += _env_keys(env)
    key_file = t.get("api_keys_file", str)
    if key_file is not None:
        with t.problems.guard():
            keys += _read_key_file(key_file, base_dir)
    return keys


SERVER_KEYS = ("host", "port", "api_keys", "api_keys_env", "api_keys_file", "max_body_bytes",
               "shutdown_timeout_s", "body_timeout_s", "access_log", "cors_origins",
               "metrics_need_api_key", "allowed_hosts")


def parse_server(data: Any, problems: Problems, base_dir: Path = Path()) -> ServerConfig:
    """The ``[server]`` table; its problems go to ``problems`` and defaults stand in."""
    t = Table(data, "server", problems)
    host = t.get("host", str, "127.0.0.1",
                 check=lambda v: non_empty(v) or _host_problem(v))
    port = t.int_in("port", 0, 65535, 8000)
    keys = _api_keys(t, base_dir)
    body: int | str = t.get("max_body_bytes", (int, str), 4 * 2**20)
    shutdown = t.get("shutdown_timeout_s", (int, float), 30.0,
                     check=lambda v: None if 0 <= v <= 3600 else "must be 0 to 3600 seconds")
    body_timeout = t.get("body_timeout_s", (int, float), 30.0,
                         check=lambda v: None if 0.1 <= v <= 3600 else
                         "must be 0.1 to 3600 seconds")
    access_log = t.get("access_log", bool, True)
    cors = t.get("cors_origins", list, [])
    for i, origin in enumerate(cors):
        if problem := cors_origin_problem(origin):
            t.problem(f"cors_origins[{i}]", problem)
    metrics_key = t.get("metrics_need_api_key", bool, True)
    hosts = t.get("allowed_hosts", list, [])
    for i, name in enumerate(hosts):
        if problem := allowed_host_problem(name):
            t.problem(f"allowed_hosts[{i}]", problem)
    t.finish(SERVER_KEYS)
    body_bytes = 4 * 2**20
    with problems.guard():
        body_bytes = parse_size(body, "server.max_body_bytes", minimum=1024)
    return ServerConfig(host, port, tuple(keys), body_bytes, float(shutdown),
                        float(body_timeout), access_log,
                        tuple(o for o in cors if not cors_origin_problem(o)), metrics_key,
                        tuple(h.lower().rstrip(".") for h in hosts
                              if not allowed_host_problem(h)))


_ORIGIN_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+$")


def cors_origin_problem(origin: object) -> str | None:
    """An origin as browsers send it (scheme://host[:port], no path), or "*" for any."""
    if origin == "*":
        return None
    if not isinstance(origin, str) or not _ORIGIN_RE.match(origin):
        return (f"{origin!r} is not an origin: give scheme://host[:port] with no path "
                "(\"https://app.example.com\", \"http://localhost:3000\") or \"*\" for any")
    return None


def allowed_host_problem(name: object) -> str | None:
    """A host as ``Host`` headers name it, without the port: a name, an IP address (IPv6
    without brackets), ".example.com" for that domain and its subdomains, or "*" for any."""
    if name == "*":
        return None
    if isinstance(name, str) and name.startswith(".") and len(name) > 1:
        name = name[1:]
    if isinstance(name, str) and name and not _host_problem(name):
        return None
    return (f"{name!r} is not a host: give a name (\"laya.example.com\"), an IP address "
            "(\"192.168.1.5\", \"::1\"; no brackets, no port), \".example.com\" for a domain "
            "and its subdomains, or \"*\" for any")


def check_host_resolves(host: str) -> None:
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
