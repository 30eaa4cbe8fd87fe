"""Per-request histograms and counters, observed on the event loop when a response is complete.

Names, types, labels and meanings are vLLM's under the ``laya:`` prefix, so that vLLM's Grafana
dashboard reads a Laya server with the prefix changed; ``laya:router_decision_seconds`` is the
layer vLLM lacks. docs/metrics.md lists every series. As in vLLM, a request with ``n`` choices
is ``n`` sequences, each observed on its own; only ``request_max_num_generation_tokens`` sees
the group. A response that never completed (an error, a client that left) is observed here not
at all: the engine counts how its sequences ended (``laya:request_success``, metrics.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from laya_core.http.dashboard import LatencyWindow
from laya_core.http.generation import Running
from laya_core.types import Timing

_FAST = (1e-6, 2e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
# Request layers, seconds. vLLM's start at 0.3 s, above a small model's whole request on a CPU.
_SLOW = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
         300, 600)
# Between two tokens, seconds: a decode step takes 2-50 ms here, and a long prefill beside it
# more. vLLM's buckets from 0.01 s, with the milliseconds below them.
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15,
              0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
# Token counts: vLLM's 1-2-5 ladder, up to a million whatever the model's context.
_TOKENS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)


class Observer:
    def __init__(self, registry: CollectorRegistry, window: LatencyWindow | None = None) -> None:
        self.window = window  # the live page's recent latencies (laya_core/http/dashboard.py)

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _SLOW) -> Histogram:
            return Histogram(f"laya:{name}", doc, ["model_name"], registry=registry,
                             buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"laya:{name}", doc, ["model_name"], registry=registry)

        self.route = hist("router_decision_seconds", "Time to choose a replica.", _FAST)
        self.queue = hist("request_queue_time_seconds", "Time waiting for room in the batch.")
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to last token.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.")
        self.itl = hist("inter_token_latency_seconds",
                        "Time between two successive tokens of a sequence.", _TOKEN_GAP)
        self.tpot = hist("time_per_output_token_seconds",
                         "The same observations as inter_token_latency_seconds (vLLM's older "
                         "name, which dashboards still query).", _TOKEN_GAP)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per sequence: decode time over its tokens after the first "
                                 "(0 for a single token).", _TOKEN_GAP)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens of a sequence.", _TOKENS)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Tokens a sequence generated.", _TOKENS)
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "Per prompt: the most tokens any of its n choices generated.", _TOKENS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")

    def finished(self, model: str, runs: Sequence[Running], timings: Sequence[Timing | None],
                 n: int) -> None:
        """A complete response: ``runs`` (``n`` per prompt) and each one's final timing."""
        for run, timing in zip(runs, timings, strict=True):
            usage = run.stream.usage
            self._sequence(model, run.route_s, timing, usage.prompt_tokens,
                           usage.completion_tokens)
        for first in range(0, len(runs), n):
            group = runs[first:first + n]
            self.max_generation_tokens.labels(model).observe(
                max(r.stream.usage.completion_tokens for r in group))

    def _sequence(self, model: str, route_s: float, timing: Timing | None, num_prompt: int,
                  num_generated: int) -> None:
        self.route.labels(model).observe(route_s)
        self.prompt_tokens.labels(model).inc(num_prompt)
        self.generation_tokens.labels(model).inc(num_generated)
        self.request_prompt_tokens.labels(model).observe(num_prompt)
        self.request_generation_tokens.labels(model).observe(num_generated)
        if timing is None:
            return
        if self.window is not None:
            self.window.add(model, route_s, timing)
        first_token_s = route_s + timing.queue_s + timing.prefill_s
        self.queue.labels(model).observe(timing.queue_s)
        self.prefill.labels(model).observe(timing.prefill_s)
        self.ttft.labels(model).observe(first_token_s)
        self.decode.labels(model).observe(timing.decode_s)
        self.e2e.labels(model).observe(first_token_s + timing.decode_s)
        gaps = timing.token_gaps_s
        itl, tpot = self.itl.labels(model), self.tpot.labels(model)
        for gap in gaps:
            itl.observe(gap)
            tpot.observe(gap)
        self.request_tpot.labels(model).observe(sum(gaps) / len(gaps) if gaps else 0.0)
