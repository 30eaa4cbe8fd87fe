"""/metrics against a real server: every series vLLM's Grafana dashboard queries exists under
``laya:`` and means what it means in vLLM, checked against the requests actually sent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from conftest import SMOLLM_BACKENDS, serving, smollm_manifest
from prometheus_client.parser import text_string_to_metric_families

from laya_core.kv.hashing import BLOCK_SIZE

# The vLLM series the panels of vLLM's published Grafana dashboard query, by name without
# the sample suffix (_bucket, _sum, _count, _total), with their type. Read from the `expr` of
# every panel of examples/observability/prometheus_grafana/grafana.json (vllm-project/vllm
# 4b5c627) and of its earlier place, examples/online_serving/prometheus_grafana/grafana.json
# (004f771), which queried time_per_output_token_seconds and gpu_cache_usage_perc before
# vLLM renamed them to inter_token_latency_seconds and kv_cache_usage_perc.
DASHBOARD_SERIES = {
    "e2e_request_latency_seconds": "histogram",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "time_to_first_token_seconds": "histogram",
    "kv_cache_usage_perc": "gauge",
    "gpu_cache_usage_perc": "gauge",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_success": "counter",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_max_num_generation_tokens": "histogram",
}
# A prompt long enough for the prefix cache (more than 16 tokens), unlike every other here.
LONG_PROMPT = ("The lighthouse keeper wrote in his log every evening: the weather, the ships "
               "that passed, the state of the lamp, and what the gulls were doing on the rocks.")


@attrs.define
class Choice:
    finish: str
    tokens: int  # generated


@attrs.define
class Sent:
    """What the workload sent and got back, to compare with what /metrics says."""

    choices: list[Choice] = attrs.field(factory=list)
    prompt_tokens: int = 0  # summed over choices, as each choice is a sequence
    prompts: int = 0  # the number of prompts: each is one group of n choices
    most_per_prompt: int = 0  # summed over prompts: the most tokens one of its choices made
    aborted_prompt_tokens: int = 0
    prefix_deltas: list[tuple[float, float]] = attrs.field(factory=list)  # (queries, hits)
    long_prompt_tokens: int = 0


def scrape(url: str) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def total(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    """The sum of ``laya:<name><suffix>`` over the samples whose labels include ``labels``."""
    family = families[f"laya:{name}"]
    return sum(s.value for s in family.samples if s.name == f"laya:{name}{suffix}"
               and labels.items() <= s.labels.items())


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json={"model": "smollm2", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
    """Finish reasons by choice index, and the usage object, of a streamed request."""
    finishes: dict[int, str] = {}
    usage: dict[str, int] = {}
    body = {"model": "smollm2", "stream": True, "stream_options": {"include_usage": True},
            **body}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
    return [finishes[i] for i in sorted(finishes)], usage


def record(sent: Sent, finishes: list[str], usage: dict[str, int], n: int = 1) -> None:
    """Add a response; with n > 1 every choice must have run to max_tokens (the test asks
    ignore_eos), so each choice's token count is known."""
    if n == 1:
        choices = [Choice(finishes[0], usage["completion_tokens"])]
    else:
        assert finishes == ["length"] * n
        choices = [Choice("length", usage["completion_tokens"] // n)] * n
    sent.choices += choices
    sent.most_per_prompt += max(c.tokens for c in choices)
    sent.prompt_tokens += usage["prompt_tokens"] * n
    sent.prompts += 1


def abort_a_stream(url: str, sent: Sent) -> None:
    """A stream whose client leaves after two events: vLLM's finished_reason "abort"."""
    prompt = "Tell me a very long story about a dragon and a knight."
    sent.aborted_prompt_tokens = httpx.post(f"{url}/tokenize", json={
        "model": "smollm2", "prompt": prompt}).json()["count"]
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break
    deadline = time.monotonic() + 10
    while total(scrape(url), "request_success", "_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the abandoned stream was never cancelled"
        time.sleep(0.05)


def run_workload(url: str) -> Sent:
    sent = Sent()
    abort_a_stream(url, sent)
    r = post(url, "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 6,
                                      "temperature": 0, "ignore_eos": True})
    record(sent, [r["choices"][0]["finish_reason"]], r["usage"])
    record(sent, *stream(url, "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 20,
                                                  "temperature": 0, "stop": [","]}))
    r = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 200,
        "temperature": 0})
    record(sent, [r["choices"][0]["finish_reason"]], r["usage"])
    record(sent, *stream(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write a poem about rain."}],
        "max_tokens": 5, "temperature": 0}))
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                                      "temperature": 0.8, "seed": 3, "ignore_eos": True})
    record(sent, [c["finish_reason"] for c in r["choices"]], r["usage"], n=2)
    refused = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": "x",
                                                         "max_tokens": 5000})
    assert refused.status_code == 400
    for _ in range(2):  # the same long prompt twice: the second reuses the first's KV
        before = scrape(url)
        r = post(url, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4,
                                          "temperature": 0, "ignore_eos": True})
        after = scrape(url)
        record(sent, [r["choices"][0]["finish_reason"]], r["usage"])
        sent.long_prompt_tokens = r["usage"]["prompt_tokens"]
        sent.prefix_deltas.append(tuple(  # type: ignore[arg-type]
            total(after, name, "_total") - total(before, name, "_total")
            for name in ("prefix_cache_queries", "prefix_cache_hits")))
    return sent


@pytest.fixture(scope="module", params=SMOLLM_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def measured(backend: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sent, dict[str, Any]]]:
    """A server of its own per backend, so that its counters hold this workload only."""
    with serving(smollm_manifest(backend),
                 tmp_path_factory.mktemp(f"metrics_{backend}")) as server:
        sent = run_workload(server.url)
        yield sent, scrape(server.url)


def test_every_dashboard_series_exists_under_the_laya_prefix(
        measured: tuple[Sent, dict[str, Any]]) -> None:
    _, families = measured
    for name, kind in DASHBOARD_SERIES.items():
        family = families.get(f"laya:{name}")
        assert family is not None, f"laya:{name} is missing"
        assert family.type == kind, (name, family.type)
        assert all(s.labels.get("model_name") == "smollm2" for s in family.samples
                   if not s.name.endswith("_created")), name
    assert {s.labels["finished_reason"] for s in families["laya:request_success"].samples
            if s.name.endswith("_total")} == {"stop", "length", "abort", "error"}


def test_request_success_counts_each_sequence_by_how_it_ended(
        measured: tuple[Sent, dict[str, Any]]) -> None:
    sent, families = measured
    reasons = [c.finish for c in sent.choices]
    assert {"stop", "length"} <= set(reasons)  # the workload met both ends
    for reason in ("stop", "length"):
        assert total(families, "request_success", "_total", finished_reason=reason) \
            == reasons.count(reason), reason
    assert total(families, "request_success", "_total", finished_reason="abort") == 1
    assert total(families, "request_success", "_total", finished_reason="error") == 0


def test_token_counts_match_the_usage_reported(measured: tuple[Sent, dict[str, Any]]) -> None:
    sent, families = measured
    generated = sum(c.tokens for c in sent.choices)
    assert total(families, "request_generation_tokens", "_sum") == generated
    assert total(families, "request_generation_tokens", "_count") == len(sent.choices)
    assert total(families, "generation_tokens", "_total") == generated
    assert total(families, "request_prompt_tokens", "_sum") == sent.prompt_tokens
    assert total(families, "request_prompt_tokens", "_count") == len(sent.choices)
    assert total(families, "prompt_tokens", "_total") == sent.prompt_tokens
    # Per prompt, the most any of its choices generated: the n = 2 request counts once.
    assert total(families, "request_max_num_generation_tokens", "_count") == sent.prompts
    assert total(families, "request_max_num_generation_tokens", "_sum") \
        == sent.most_per_prompt < generated


def test_inter_token_latency_has_one_gap_per_token_after_the_first(
        measured: tuple[Sent, dict[str, Any]]) -> None:
    sent, families = measured
    gaps = sum(c.tokens - 1 for c in sent.choices)
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert total(families, name, "_count") == gaps, name
        assert total(families, name, "_bucket", le="+Inf") == gaps, name
    assert total(families, "request_time_per_output_token_seconds", "_count") \
        == len(sent.choices)
    # The gaps of a sequence add up to its decode time, up to the bookkeeping after the
    # last token.
    decode = total(families, "request_decode_time_seconds", "_sum")
    assert 0 < total(families, "inter_token_latency_seconds", "_sum") <= decode


def test_latency_histograms_count_each_sequence_once(
        measured: tuple[Sent, dict[str, Any]]) -> None:
    sent, families = measured
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "router_decision_seconds"):
        assert total(families, name, "_count") == len(sent.choices), name
    assert total(families, "e2e_request_latency_seconds", "_sum") \
        > total(families, "time_to_first_token_seconds", "_sum") > 0


def test_prefix_cache_counts_tokens_queried_and_hit(
        measured: tuple[Sent, dict[str, Any]], backend: str) -> None:
    sent, families = measured
    (first_q, first_h), (second_q, second_h) = sent.prefix_deltas
    n = sent.long_prompt_tokens
    assert (first_q, first_h) == (n, 0)
    reused = n - 2  # the cache leaves the last chunk, two prompt tokens, to compute
    if backend == "torch":  # on the core's paged pool, in whole blocks
        reused -= reused % BLOCK_SIZE
    assert (second_q, second_h) == (n, reused)
    # Every admitted prompt is looked up, the abandoned stream's too.
    assert total(families, "prefix_cache_queries", "_total") \
        == sent.prompt_tokens + sent.aborted_prompt_tokens
    assert total(families, "prefix_cache_hit_sequences", "_total") >= 1


def test_gauges_read_the_live_state(measured: tuple[Sent, dict[str, Any]]) -> None:
    _, families = measured
    assert total(families, "num_requests_running") == 0
    assert total(families, "num_requests_waiting") == 0
    assert total(families, "kv_cache_usage_perc") == total(families, "gpu_cache_usage_perc")

