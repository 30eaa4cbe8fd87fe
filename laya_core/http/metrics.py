"""Prometheus metrics, read from the deployment's live state at scrape time.

Names follow vLLM's where one exists (``num_requests_running``, ``kv_cache_usage_perc``,
``request_success``), under the ``laya:`` prefix, with vLLM's meaning; docs/metrics.md lists
every series.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from laya_core.engine.layer_clock import merged
from laya_core.serving.deployment import Deployment
from laya_core.types import FinishReason

_LABELS = ["model_name", "replica"]
# vLLM's finished_reason values: "abort" is a sequence cancelled because its client went away
# (or the server stopped), "error" one the backend failed.
_FINISHED_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                    FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}


class DeploymentCollector:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def collect(self) -> Iterator[Metric]:
        d = self.deployment

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"laya:{name}", doc, labels=_LABELS)

        running = gauge("num_requests_running", "Sequences in the running batch.")
        waiting = gauge("num_requests_waiting", "Requests waiting for room in the KV cache.")
        usage = gauge("kv_cache_usage_perc", "Fraction of the KV pool in use (0 to 1).")
        gpu_usage = gauge("gpu_cache_usage_perc",
                          "kv_cache_usage_perc under vLLM's older name, for dashboards.")
        used = gauge("kv_cache_used_tokens", "KV cache tokens reserved by live sequences.")
        capacity = gauge("kv_cache_capacity_tokens", "Tokens the fixed KV pool holds.")
        cached = gauge("kv_cache_cached_tokens",
                       "KV tokens of finished sequences kept for prefix reuse (reclaimable).")
        queries = CounterMetricFamily("laya:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.",
                                      labels=_LABELS)
        hits = CounterMetricFamily("laya:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (not prefilled).",
                                   labels=_LABELS)
        hit_seqs = CounterMetricFamily("laya:prefix_cache_hit_sequences",
                                       "Sequences that reused cached KV.", labels=_LABELS)
        success = CounterMetricFamily("laya:request_success",
                                      "Sequences ended, by vLLM's finished_reason.",
                                      labels=[*_LABELS, "finished_reason"])
        rejected = CounterMetricFamily("laya:request_rejections", "Requests refused, by reason.",
                                       labels=[*_LABELS, "reason"])
        up = gauge("replica_up", "1 while the replica serves; 0 loading, restarting or failed.")
        restarts = CounterMetricFamily("laya:replica_restarts",
                                       "Times the replica's worker process was started again "
                                       "after it died or was killed as stuck.", labels=_LABELS)
        layers = CounterMetricFamily(
            "laya:engine_layer_seconds", "Seconds spent in each layer of the replica's "
            "tokens (docs/metrics.md lists the layers).", labels=[*_LABELS, "layer"])
        steps = CounterMetricFamily("laya:engine_steps", "Engine steps that ran the backend.",
                                    labels=_LABELS)
        sampled = CounterMetricFamily("laya:engine_generated_tokens",
                                      "Tokens the engine sampled, as they come.", labels=_LABELS)
        # vLLM's spec_decode series: their ratio is the acceptance rate, and accepted tokens
        # over drafts is the mean number of draft tokens kept per check.
        drafts = CounterMetricFamily("laya:spec_decode_num_drafts",
                                     "Drafts checked by speculative decoding.", labels=_LABELS)
        draft_tokens = CounterMetricFamily("laya:spec_decode_num_draft_tokens",
                                           "Draft tokens checked.", labels=_LABELS)
        accepted = CounterMetricFamily("laya:spec_decode_num_accepted_tokens",
                                       "Draft tokens the model kept.", labels=_LABELS)
        snap = d.snapshot()
        for client, e in snap.replicas:
            labels = [e.model, str(e.replica_id)]
            up.add_metric(labels, 1 if e.ready else 0)
            restarts.add_metric(labels, getattr(client, "restarts", 0))
            running.add_metric(labels, e.num_running)
            waiting.add_metric(labels, e.num_waiting)
            usage.add_metric(labels, e.kv_usage)
            gpu_usage.add_metric(labels, e.kv_usage)
            used.add_metric(labels, e.kv_used_tokens)
            capacity.add_metric(labels, e.kv_capacity_tokens)
            cached.add_metric(labels, e.kv_cached_tokens)
            queries.add_metric(labels, e.prefix_queried_tokens)
            hits.add_metric(labels, e.prefix_tokens_reused)
            hit_seqs.add_metric(labels, e.prefix_hits)
            for end, count in e.finished.items():
                success.add_metric([*labels, _FINISHED_REASON[end]], count)
            for reason, count in e.rejections.items():
                rejected.add_metric([*labels, reason], count)
            for layer, seconds in merged(e.layer_seconds, client.clock.seconds()).items():
                layers.add_metric([*labels, layer], seconds)
            steps.add_metric(labels, e.num_steps)
            sampled.add_metric(labels, e.generated_tokens)
            drafts.add_metric(labels, e.spec_drafts)
            draft_tokens.add_metric(labels, e.spec_draft_tokens)
            accepted.add_metric(labels, e.spec_accepted_tokens)
        for model, counts in snap.front_rejections.items():
            for reason, count in counts.items():
                rejected.add_metric([model, "", reason], count)
        yield from (running, waiting, usage, gpu_usage, used, capacity, cached, queries, hits,
                    hit_seqs, success, rejected, up, restarts, layers, steps, sampled, drafts,
                    draft_tokens, accepted)
        yield from _sandbox(d)
        yield from _residency(d)
        if d.plan is not None:
            budget = GaugeMetricFamily("laya:memory_budget_bytes", "The memory budget in force.")
            budget.add_metric([], d.plan.budget.bytes)
            planned = GaugeMetricFamily("laya:memory_planned_bytes",
                                        "The plan's total: weights, KV pools and overheads.")
            planned.add_metric([], d.plan.total_bytes)
            pool = GaugeMetricFamily("laya:kv_cache_pool_bytes", "Bytes of each fixed KV pool.",
                                     labels=_LABELS)
            for r in d.plan.replicas:
                pool.add_metric([r.model, str(r.replica)], r.kv_pool_bytes)
            yield from (budget, planned, pool)


def _residency(d: Deployment) -> Iterator[Metric]:
    """The models loaded on demand (laya_core/serving/residency.py)."""
    if not d.residency.residents:
        return
    labels = ["model_name"]
    loaded = GaugeMetricFamily("laya:model_loaded", "1 while the on-demand model is loaded; "
                               "0 unloaded, loading, unloading or failed.", labels=labels)
    loads = CounterMetricFamily("laya:model_loads", "Times the on-demand model loaded.",
                                labels=labels)
    unloads = CounterMetricFamily("laya:model_unloads", "Times the on-demand model was "
                                  "unloaded, by reason: idle, evicted (for another's room), "
                                  "asked (POST /models/unload).", labels=[*labels, "reason"])
    seconds = CounterMetricFamily("laya:model_load_seconds", "Seconds the on-demand model's "
                                  "loads took, all together.", labels=labels)
    resident = GaugeMetricFamily("laya:memory_resident_planned_bytes", "The planned bytes of "
                                 "the runtime, the pinned models and the on-demand models "
                                 "resident now (never above the budget).")
    for name in d.residency.residents:
        status = d.residency.status(name)
        assert status is not None
        loaded.add_metric([name], 1 if status["status"] == "loaded" else 0)
        loads.add_metric([name], status["loads"])
        for reason in ("idle", "evicted", "asked"):
            unloads.add_metric([name, reason], status["unloads"].get(reason, 0))
        seconds.add_metric([name], status["load_seconds_total"])
    resident.add_metric([], d.residency.resident_bytes())
    yield from (loaded, loads, unloads, seconds, resident)


def _sandbox(d: Deployment) -> Iterator[Metric]:
    """The chat-template sandbox's child process (laya_core/serving/template_sandbox.py)."""
    up = GaugeMetricFamily("laya:template_sandbox_up",
                           "1 while the chat-template sandbox can render; 0 while its child "
                           "process is dead and not yet replaced.")
    up.add_metric([], 1 if d.templates.up else 0)
    restarts = CounterMetricFamily("laya:template_sandbox_restarts",
                                   "Times the chat-template sandbox's child was replaced: it "
                                   "died, stopped answering, or a render broke a bound.")
    restarts.add_metric([], d.templates.num_restarts)
    yield from (up, restarts)


def metrics_registry(deployment: Deployment) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DeploymentCollector(deployment))  # type: ignore[arg-type]
    return registry
