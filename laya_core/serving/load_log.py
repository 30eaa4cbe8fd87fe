"""The line a replica logs each time it has loaded: how long it took (or which restart it
came back from), its planned and resident memory, and how its backend runs."""

from __future__ import annotations

import logging
from typing import Any

from laya_core.memory.ledger import ReplicaLedger
from laya_core.units import fmt_bytes

log = logging.getLogger("laya_core.serving.deployment")  # where this line was always logged


def log_loaded(name: str, replica: int, took_s: float, kv_tokens: int,
               runtime: dict[str, Any], rss: int | None, ledger: ReplicaLedger | None) -> None:
    """Log that ``name``'s replica ``replica`` serves; ``runtime``: Backend.describe and the
    transport's facts (``restarts`` among them)."""
    restarts = runtime.get("restarts", 0)
    log.info("%s replica %d %s: %s; %s", name, replica,
             f"ready in {took_s:.1f} s" if not restarts else f"back after restart {restarts}",
             memory_of(kv_tokens, rss, ledger),
             "; ".join(f"{k} {plain(v)}" for k, v in runtime.items()) or "-")


def memory_of(kv_tokens: int, rss: int | None, ledger: ReplicaLedger | None) -> str:
    """The replica's planned bytes (weights, KV pool) and its process's resident set."""
    parts = [f"KV pool {kv_tokens} tokens"]
    if ledger is not None:
        parts = [f"weights {fmt_bytes(ledger.profile.weights_bytes)}",
                 f"KV pool {fmt_bytes(ledger.kv_pool_bytes)} ({ledger.pool_tokens} tokens)",
                 f"planned {fmt_bytes(ledger.total_bytes)}"]
    if rss is not None:
        parts.append(f"process resident {fmt_bytes(rss)}")
    return ", ".join(parts)


def plain(value: object) -> str:
    """A log line's rendering of a JSON-like value."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {plain(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "-"
    return str(value)
