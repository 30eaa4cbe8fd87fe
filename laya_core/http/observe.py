"""Per-request histograms and counters, observed when a request finishes.

Names follow vLLM's (``time_to_first_token_seconds``, ``request_queue_time_seconds``, ...)
under the ``laya:`` prefix, plus ``laya:router_decision_seconds`` for the layer vLLM lacks.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from laya_core.types import Timing

_FAST = (1e-6, 2e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Observer:
    def __init__(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...] = _SLOW) -> Histogram:
            return Histogram(f"laya:{name}", doc, ["model_name"], registry=registry,
                             buckets=buckets)

        self.route = hist("router_decision_seconds", "Time to choose a replica.", _FAST)
        self.queue = hist("request_queue_time_seconds", "Time waiting for room in the batch.")
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to last token.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.")
        self.prompt_tokens = Counter("laya:prompt_tokens", "Prompt tokens processed.",
                                     ["model_name"], registry=registry)
        self.generation_tokens = Counter("laya:generation_tokens", "Tokens generated.",
                                         ["model_name"], registry=registry)

    def finished(self, model: str, route_s: float, timing: Timing | None,
                 usage: dict[str, int]) -> None:
        self.route.labels(model).observe(route_s)
        self.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(model).inc(usage["completion_tokens"])
        if timing is None:
            return
        self.queue.labels(model).observe(timing.queue_s)
        self.prefill.labels(model).observe(timing.prefill_s)
        self.ttft.labels(model).observe(route_s + timing.queue_s + timing.prefill_s)
        self.decode.labels(model).observe(timing.decode_s)
        self.e2e.labels(model).observe(route_s + timing.queue_s + timing.prefill_s +
                                       timing.decode_s)
