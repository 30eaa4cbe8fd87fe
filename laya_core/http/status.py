"""The deployment's state as JSON for /ready: replicas, memory plan, KV use, queues."""

from __future__ import annotations

from typing import Any

from laya_core.serving.deployment import Deployment


def deployment_status(d: Deployment) -> dict[str, Any]:
    ledgers = {r.replica: r for r in d.plan.replicas} if d.plan else {}
    snap = d.snapshot()
    replicas = []
    for client, s in snap.replicas:
        ledger = ledgers.get(s.replica_id)
        per_token = ledger.profile.kv_bytes_per_token if ledger else 0
        replicas.append({
            "model": s.model, "replica": s.replica_id, "state": d.replica_state(client, s),
            "error": s.error, "running": s.num_running, "waiting": s.num_waiting,
            "kv_cache_capacity_tokens": s.kv_capacity_tokens,
            "kv_cache_used_tokens": s.kv_used_tokens,
            "kv_cache_used_bytes": s.kv_used_tokens * per_token,
            "kv_cache_cached_tokens": s.kv_cached_tokens,
            "prefix_cache_hits": s.prefix_hits,
            "prefix_cache_tokens_reused": s.prefix_tokens_reused,
            "embedded_tokens": s.embedded_tokens,
            "kv_pool_bytes": ledger.kv_pool_bytes if ledger else None,
            "rejections": dict(s.rejections),
            "runtime": client.runtime(),
        })
    memory = None
    if d.plan is not None:
        memory = {"budget_bytes": d.plan.budget.bytes, "budget_source": d.plan.budget.source,
                  "planned_bytes": d.plan.total_bytes}
    rejections = {model: dict(counts) for model, counts in snap.front_rejections.items()}
    return {"replicas": replicas, "memory": memory, "rejections": rejections,
            "template_sandbox": d.templates.status()}
