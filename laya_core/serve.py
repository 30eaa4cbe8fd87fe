"""Runs a deployment behind Hypercorn until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from laya_core.deployment import Deployment
from laya_core.http import create_app
from laya_core.manifest import Manifest
from laya_core.memory_plan import Plan
from laya_core.plugins import Registry

log = logging.getLogger("laya")
_LOAD_WATCH_S = 0.2


def hypercorn_config(manifest: Manifest) -> Config:
    config = Config()
    host = manifest.server.host
    config.bind = [f"[{host}]:{manifest.server.port}" if ":" in host
                   else f"{host}:{manifest.server.port}"]
    config.accesslog = None
    # After SIGTERM/SIGINT Hypercorn stops accepting and lets in-flight requests (streams
    # included) run this long; what is left is cancelled and the engines then stop.
    config.graceful_timeout = manifest.server.shutdown_timeout_s
    return config


async def _stop_when_nothing_loads(deployment: Deployment, stop: asyncio.Event) -> None:
    """A server none of whose models loaded serves nothing: end it, rather than answer
    every request with an error for ever. A model that failed beside others that loaded
    only marks itself failed (/ready and its requests say why)."""
    while not stop.is_set():
        if deployment.all_failed:
            stop.set()
            return
        await asyncio.sleep(_LOAD_WATCH_S)


async def _serve(deployment: Deployment) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(deployment)
    watch = asyncio.create_task(_stop_when_nothing_loads(deployment, stop))
    try:
        await hypercorn_serve(app, hypercorn_config(deployment.manifest),  # type: ignore[arg-type]
                              shutdown_trigger=stop.wait)
    finally:
        watch.cancel()


def serve(manifest: Manifest, registry: Registry, plan: Plan | None = None) -> int:
    """Load every replica, serve HTTP, and return an exit status."""
    deployment = Deployment(manifest, registry, plan)
    deployment.start()
    server = manifest.server
    print(f"laya: loading {len(deployment.engines)} replica(s); serving on "
          f"http://{server.host}:{server.port} (router: {deployment.router_name})", flush=True)
    try:
        asyncio.run(_serve(deployment))
    finally:
        # Shutting down already: a repeated SIGTERM must not cut the engines' cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deployment.stop()
    failed = [e for e in deployment.engines if e.error]
    for engine in failed:
        print(f"laya: {engine.config.name} replica {engine.replica_id} failed to load: "
              f"{engine.error}", flush=True)
    return 1 if failed else 0
