"""laya:engine_layer_seconds_total against a real server: every layer of a streamed token
is counted, grows with the tokens generated, and no thread's layers add up to more time than
the run took (laya_core/engine/layer_clock.py)."""

from __future__ import annotations

import time

import httpx
from conftest import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from laya_core.engine.layer_clock import LAYERS

# The thread each layer runs on; one thread's layers never overlap, different threads' may.
THREADS = {"engine": ("loop", "schedule", "prefill", "backend", "detokenize", "deliver"),
           "worker": ("ipc_send",), "front": ("ipc_receive",), "event loop": ("http",)}


def counters(url: str) -> dict[str, float]:
    """Layer seconds, steps and sampled tokens of the smollm2 replicas."""
    out = dict.fromkeys(LAYERS, 0.0) | {"steps": 0.0, "tokens": 0.0}
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") != "smollm2":
                continue
            if family.name == "laya:engine_layer_seconds":
                out[s.labels["layer"]] += s.value
            elif family.name == "laya:engine_steps":
                out["steps"] += s.value
            elif family.name == "laya:engine_generated_tokens":
                out["tokens"] += s.value
    return out


def stream(url: str, max_tokens: int) -> int:
    """One streamed chat completion read to its end; its completion tokens."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"usage"' in line and '"choices":[]' in line.replace(" ", ""):
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    return tokens


def settled(url: str) -> dict[str, float]:
    """The counters once the worker's idle state message (every 0.25 s) has carried its
    last step message's own send."""
    time.sleep(0.6)
    return counters(url)


def test_layers_grow_with_tokens_within_the_wall_time(smollm_server: ServerProcess) -> None:
    url = smollm_server.url
    stream(url, 4)  # any first-request cost before the measured run
    start = time.perf_counter()
    before = counters(url)
    tokens = [stream(url, 12), stream(url, 12)]
    after = settled(url)
    wall_s = time.perf_counter() - start
    grown = {k: after[k] - before[k] for k in after}
    assert grown["tokens"] == sum(tokens) == 24
    assert grown["steps"] >= 22  # a prefill and 11 decodes a request, or more in chunks
    assert all(v >= 0 for v in grown.values()), grown
    # Every layer ran: the model, the engine loop's own work, the worker process's step
    # message, and the front end's side of it and the SSE writes; all but a draft model's,
    # which runs only where speculative.method is "draft".
    for layer in LAYERS:
        assert grown[layer] > 0 or layer == "draft", (layer, grown)
    assert grown["draft"] == 0
    for thread, layers in THREADS.items():
        assert sum(grown[layer] for layer in layers) <= wall_s, (thread, grown, wall_s)
    # More tokens, more time in every per-token layer.
    stream(url, 12)
    again = settled(url)
    for layer in ("backend", "detokenize", "deliver", "ipc_send", "ipc_receive", "http"):
        assert again[layer] > after[layer], layer
