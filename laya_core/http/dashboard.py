"""The live page: ``GET /`` (``/dashboard``) and its data, ``GET /live``.

The page is plain HTML, JS and CSS shipped in this package (``static/``): no build step and
nothing fetched from elsewhere. It polls ``/live`` (one JSON snapshot, spec/openapi.yaml's
``LiveSnapshot``) twice a second. Polling rather than a server-sent stream: each poll is a
short request like any other, so an open page holds no task, queue or connection on the
server between polls, and a closed one leaves nothing behind. The page loads without an API
key; ``/live`` needs one like every data endpoint, and the page asks for it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.logs import resident_bytes
from laya_core.memory.ledger import ReplicaLedger
from laya_core.serving.deployment import Deployment
from laya_core.types import Timing

# The page's own files: what the API-key check lets through (they hold no data or key).
ASSETS = {"/": ("dashboard.html", "text/html; charset=utf-8"),
          "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
          "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/dashboard/app.css": ("app.css", "text/css; charset=utf-8")}
OPEN_PATHS = frozenset(ASSETS)
# What the page may do, whoever serves or frames it: run and style itself from its own files
# only (app.js sets the bars' widths through the DOM, never in style attributes), fetch from
# this server only, submit no form anywhere, and be framed by no page (a framing page could
# trick a click on the chat's Send). nosniff keeps each file the type it is served as.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers older than CSP 2
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
POLL_INTERVAL_MS = 500  # what the page waits between two polls
WINDOW_S = 60.0  # latency percentiles cover the sequences finished this recently
MAX_SAMPLES = 2048  # per model, so a burst of short requests cannot grow the window
RATE_S = 3.0  # tokens/s: the replicas' generated-token counters over about the last 3 s
# A poll measures from no earlier poll closer than this (two pages, the first polls): a few
# tokens over a few milliseconds would read thousands per second. The rate read before stands.
MIN_RATE_S = 0.25
LAYERS = ("route", "queue", "prefill", "decode")


@attrs.frozen
class _Sample:
    at: float  # time.monotonic() when the sequence finished
    seconds: tuple[float, float, float, float]  # route, queue, prefill, decode


class LatencyWindow:
    """Each model's recently finished sequences, for the page's p50/p99, and its
    generated-token count as each poll saw it, for a live tokens/s.

    The event loop adds one sample per complete sequence (laya_core/http/observe.py) and
    reads summaries; both run on the loop, so no lock. Bounded by time and count.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: dict[str, deque[_Sample]] = {}
        # (time, the model's generated tokens) per poll: those of the last RATE_S and the
        # newest one before them, whatever its age.
        self._counts: dict[str, deque[tuple[float, int]]] = {}
        self._rates: dict[str, float] = {}  # the rate each model's last poll read

    def add(self, model: str, route_s: float, timing: Timing) -> None:
        samples = self._samples.setdefault(model, deque(maxlen=MAX_SAMPLES))
        samples.append(_Sample(self._clock(), (route_s, timing.queue_s, timing.prefill_s,
                                               timing.decode_s)))

    def tokens_per_s(self, model: str, generated: int) -> float:
        """Tokens generated per second, from the replicas' counters (``generated``: their
        sum now), whether or not sequences finished. Measured from the oldest poll of the
        last :data:`RATE_S`, or where there is none (polls further apart) from the one
        before, whatever its age: at the page's pace the rate covers about 3 s, and a client
        that polls every 10 s reads it over those 10 s."""
        now = self._clock()
        counts = self._counts.setdefault(model, deque(maxlen=MAX_SAMPLES))
        if counts and generated < counts[-1][1]:  # a replica restarted: its count began anew
            counts.clear()
            self._rates[model] = 0.0
        # Keep the newest poll older than RATE_S: it is the base when no newer one is.
        while len(counts) > 1 and now - counts[1][0] > RATE_S:
            counts.popleft()
        base = next((c for c in counts if MIN_RATE_S <= now - c[0] <= RATE_S), None)
        if base is None and counts and now - counts[0][0] > RATE_S:
            base = counts[0]
        if base is not None:
            then, before = base
            self._rates[model] = (generated - before) / (now - then)
        counts.append((now, generated))
        return self._rates.setdefault(model, 0.0)

    def summary(self, model: str, generated: int = 0) -> dict[str, Any]:
        now = self._clock()
        samples = self._samples.get(model, deque())
        while samples and samples[0].at < now - WINDOW_S:
            samples.popleft()
        out: dict[str, Any] = {"window_s": WINDOW_S, "sequences": len(samples)}
        for i, layer in enumerate(LAYERS):
            ms = sorted(s.seconds[i] * 1000 for s in samples)
            out[f"{layer}_ms"] = {"p50": _percentile(ms, 0.50), "p99": _percentile(ms, 0.99)}
        out["tokens_per_s"] = self.tokens_per_s(model, generated)
        return out


def _percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank percentile of a sorted list; None when it is empty."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _ledger(ledger: ReplicaLedger | None) -> dict[str, Any] | None:
    if ledger is None:
        return None
    return {"weights_bytes": ledger.profile.weights_bytes,
            "kv_pool_bytes": ledger.kv_pool_bytes, "overhead_bytes": ledger.overhead_bytes,
            "overheads": [{"name": o.name, "bytes": o.bytes}
                          for o in ledger.profile.overheads],
            "total_bytes": ledger.total_bytes}


def snapshot(d: Deployment, window: LatencyWindow) -> dict[str, Any]:
    """What the page shows, now: per model and replica the ledger, measured RSS, KV blocks,
    prefix-cache hits, queues and rejections; per model the latency window."""
    ledgers = {r.replica: r for r in d.plan.replicas} if d.plan else {}
    snap = d.snapshot()
    states = [s for _, s in snap.replicas]
    generated = {name: sum(s.generated_tokens for s in states if s.model == name)
                 for name in d.models}
    models: dict[str, dict[str, Any]] = {
        name: {"name": name, "replicas": [], "rejections": snap.rejections_of(name),
               "latency": window.summary(name, generated[name]),
               "load": d.models[name].load, "residency": d.residency.status(name)}
        for name in d.models}
    for client, s in snap.replicas:
        model = models[s.model]
        # A worker process's RSS is its own; a replica on a thread of the front end has
        # none of its own (the front end's, under "memory", holds it).
        rss = getattr(client, "resident_bytes", None)
        block = d.block_sizes[s.model]
        total, used, cached = (_blocks(s.kv_capacity_tokens, block),
                               _blocks(s.kv_used_tokens, block),
                               _blocks(s.kv_cached_tokens, block))
        model["replicas"].append({
            "replica": s.replica_id, "state": d.replica_state(client, s), "error": s.error,
            "process": "worker" if rss is not None else "front end",
            "rss_bytes": rss() if rss is not None else None,
            "ledger": _ledger(ledgers.get(s.replica_id)),
            "kv": {"block_tokens": block, "blocks_total": total, "blocks_used": used,
                   "blocks_cached": cached, "blocks_free": max(0, total - used - cached),
                   "capacity_tokens": s.kv_capacity_tokens, "used_tokens": s.kv_used_tokens,
                   "cached_tokens": s.kv_cached_tokens},
            "prefix_cache": {"hit_sequences": s.prefix_hits,
                             "queried_tokens": s.prefix_queried_tokens,
                             "hit_tokens": s.prefix_tokens_reused},
            "running": s.num_running, "waiting": s.num_waiting,
            "rejections": dict(s.rejections),
            "speculative": {"drafts": s.spec_drafts, "draft_tokens": s.spec_draft_tokens,
                            "accepted_tokens": s.spec_accepted_tokens}})
    memory = None
    if d.plan is not None:
        memory = {"budget_bytes": d.plan.budget.bytes, "budget_source": d.plan.budget.source,
                  "planned_bytes": d.plan.total_bytes, "runtime_bytes": d.plan.runtime_bytes,
                  "resident_planned_bytes": d.residency.resident_bytes()}
    return {"time": time.time(), "poll_interval_ms": POLL_INTERVAL_MS, "ready": snap.ready,
            "front_end_rss_bytes": resident_bytes(), "memory": memory,
            "models": list(models.values())}


def _asset(name: str) -> bytes:
    return (resources.files("laya_core.http") / "static" / name).read_bytes()


def live_routes(deployment: Deployment, window: LatencyWindow) -> list[Route]:
    """The page's files and ``GET /live``."""
    files = {path: (_asset(name), media) for path, (name, media) in ASSETS.items()}

    async def page(request: Request) -> Response:
        body, media = files[request.url.path]
        return Response(body, media_type=media, headers=PAGE_HEADERS)

    async def live(request: Request) -> Response:
        return JSONResponse(snapshot(deployment, window),
                            headers={"Cache-Control": "no-store"})

    return [*(Route(path, page) for path in ASSETS), Route("/live", live)]
