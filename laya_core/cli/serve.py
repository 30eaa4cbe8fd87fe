"""Runs a deployment behind Hypercorn until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Sequence

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from laya_core.config.manifest import Manifest, ServerConfig
from laya_core.engine.state import EngineState
from laya_core.http import create_app
from laya_core.memory.ledger import Plan
from laya_core.plugins import Registry
from laya_core.serving.deployment import Deployment
from laya_core.serving.models_dir import ModelsDirWatcher

log = logging.getLogger("laya")
_LOAD_WATCH_S = 0.2


def hypercorn_config(manifest: Manifest, listener: socket.socket | None = None) -> Config:
    config = Config()
    host = manifest.server.host
    config.bind = [f"[{host}]:{manifest.server.port}" if ":" in host
                   else f"{host}:{manifest.server.port}"]
    if listener is not None:  # bound and listening already; Hypercorn takes the descriptor
        config.bind = [f"fd://{listener.fileno()}"]
    config.accesslog = None
    # Handed a logger, Hypercorn adds no handler of its own: its lines reach the root
    # handler only, once (laya_core/logs.py).
    config.errorlog = logging.getLogger("hypercorn.error")
    # After SIGTERM/SIGINT Hypercorn stops accepting and lets in-flight requests (streams
    # included) run this long; what is left is cancelled and the engines then stop.
    config.graceful_timeout = manifest.server.shutdown_timeout_s
    return config


def listen(server: ServerConfig) -> socket.socket:
    """The listening socket, opened before any model loads: a port in use fails at once,
    connections made while the models load wait in the backlog, and with port 0 the URL
    logged is the one the kernel chose."""
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    sock = socket.create_server((server.host, server.port), family=family)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


class _Stop:
    """Why the server stops, said once, and the event Hypercorn's shutdown waits on."""

    def __init__(self, timeout_s: float) -> None:
        self.event = asyncio.Event()
        self.timeout_s = timeout_s

    def __call__(self, reason: str) -> None:
        if not self.event.is_set():
            log.info("shutting down (%s); in-flight requests have up to %g s", reason,
                     self.timeout_s)
            self.event.set()


def _models_line(deployment: Deployment) -> str:
    """"smollm2 (2 replicas), big (1 replica)", then what failed."""
    served, failed, on_demand = [], [], []
    for name in deployment.models:
        if deployment.residency.on_demand(name):
            on_demand.append(name)
            continue
        states = [c.state().state for c in deployment.clients_of(name)]
        ready = sum(s is EngineState.READY for s in states)
        if ready:
            served.append(f"{name} ({ready} replica{'s' if ready > 1 else ''})")
        if ready < len(states):
            failed.append(name)
    parts = [", ".join(served) or "no model loaded yet"]
    if failed:
        parts.append(f"failed to load: {', '.join(failed)}")
    if on_demand:
        parts.append(f"loaded on demand: {', '.join(on_demand)}")
    return "; ".join(parts)


async def _watch_load(deployment: Deployment, stop: _Stop, url: str) -> None:
    """Say when every replica has loaded. A server none of whose models loaded serves
    nothing: end it, rather than answer every request with an error for ever. A model that
    failed beside others that loaded only marks itself failed (/ready and its requests say
    why)."""
    while deployment.loading:
        await asyncio.sleep(_LOAD_WATCH_S)
    if deployment.all_failed:
        stop("no model loaded: every replica failed")
        return
    took = time.monotonic() - (deployment.started_at or time.monotonic())
    log.info("ready in %.1f s on %s: %s", took, url, _models_line(deployment))


async def _serve(deployment: Deployment, listener: socket.socket, url: str) -> None:
    stop = _Stop(deployment.manifest.server.shutdown_timeout_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig.name)
    app = create_app(deployment)
    config = hypercorn_config(deployment.manifest, listener)
    listener.detach()  # the descriptor is Hypercorn's now: it closes it when it stops
    watch = asyncio.create_task(_watch_load(deployment, stop, url))
    try:
        await hypercorn_serve(app, config,  # type: ignore[arg-type]
                              shutdown_trigger=stop.event.wait)
    finally:
        watch.cancel()


def serve(manifest: Manifest, registry: Registry, plan: Plan | None = None,
          worker_plugins: Sequence[str] = ()) -> int:
    """Load every replica, serve HTTP, and return an exit status. ``worker_plugins``:
    ``module:attribute`` plugins of ``registry`` that are not installed, for the worker
    processes to register too (a program that brings its own backend)."""
    server = manifest.server
    try:
        listener = listen(server)
    except OSError as e:
        log.error("cannot listen on %s port %d: %s", server.host, server.port,
                  e.strerror or e)
        return 1
    # After listening: building the deployment may start processes (a local Ray's) that
    # bind ports of their own, and must not take the one the server was given.
    try:
        deployment = Deployment(manifest, registry, plan, processes=True,
                                worker_plugins=worker_plugins)
    except BaseException:
        listener.close()
        raise
    url = url_of(listener)
    pinned = [n for n in deployment.models if not deployment.residency.on_demand(n)]
    log.info("loading %d replica(s) of %s in %s; listening on %s (router: %s)",
             sum(len(deployment.clients_of(n)) for n in pinned), ", ".join(pinned) or
             "no model (each loads at its first request)",
             "worker processes" if deployment.processes else "this process", url,
             deployment.router_name)
    deployment.start()
    watcher = None
    if manifest.models_dir is not None:  # models copied in later are served too
        watcher = ModelsDirWatcher(deployment, manifest.models_dir, registry)
        watcher.start()
    try:
        asyncio.run(_serve(deployment, listener, url))
    finally:
        # Shutting down already: a repeated SIGTERM must not cut the engines' cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if watcher is not None:
            watcher.stop()
        deployment.stop()
    failed = [s for s in (c.state() for c in deployment.clients) if s.error]
    for state in failed:
        log.error("%s replica %d failed to load: %s", state.model, state.replica_id,
                  state.error)
    return 1 if failed else 0
