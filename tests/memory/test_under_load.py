"""Proof under load: 64 concurrent long requests against a small budget.

Peak RSS stays within the plan (plus 10%), every request completes or is refused with 429/503
and Retry-After, /health answers throughout, and the KV cache is empty afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from conftest import ServerProcess

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[memory]
# room for the same KV pool as before the 64 MiB template sandbox, 11 MiB of saved KV,
# 237 MiB of grammars (the index, the cache, one compile, the compile child), and the
# worker process with the front end's tokenizer
budget = "730MiB"

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 512
max_num_seqs = 4
max_step_tokens = 128
max_queue = 16
queue_timeout_s = 15
"""
TOLERANCE = 0.10
PROMPT = ("Here is a long story about a lighthouse keeper who kept a diary of every ship that "
          "passed, the weather of each day, and the birds that landed on the rail. ") * 4


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self.at_peak: list[tuple[int, str, int]] = []  # (pid, command, RSS) at the peak
        self.running = True

    def run(self) -> None:
        """The server's RSS with its children's (the replica's worker process, the template
        sandbox): the plan is for all of them."""
        while self.running:
            total, each = 0, []
            for p in [self.process, *self.process.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss = p.memory_info().rss
                    total += rss
                    each.append((p.pid, " ".join(p.cmdline()[:4])[-80:], rss))
            if total > self.peak:
                self.peak, self.at_peak = total, each
            time.sleep(0.01)


async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, bool]:
    """Status, finish reason (when 200) and whether a refusal carried Retry-After."""
    body = {"model": "smollm2", "prompt": f"{i}. {PROMPT}", "max_tokens": 200,
            "temperature": 0.8, "seed": i, "stream": i % 2 == 0}
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
        return r.status_code, finish, "retry-after" in r.headers
    async with client.stream("POST", "/v1/completions", json=body) as r:
        finish = None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
        return r.status_code, finish, "retry-after" in r.headers


async def health_watch(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        r = await client.get("/health")
        assert r.status_code == 200
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.1)
    return latencies


async def load(url: str) -> tuple[list[tuple[int, str | None, bool]], list[float]]:
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(health_watch(client, stop))
        results = await asyncio.gather(*(one(client, i) for i in range(64)))
        stop.set()
        return results, await watcher


def test_memory_holds_under_64_concurrent_long_requests(tmp_path: Path) -> None:
    server = ServerProcess(MANIFEST, tmp_path)
    try:
        server.wait_ready()
        plan = json.loads(subprocess.run(
            [sys.executable, "-m", "laya_core.cli.main", "plan", "--json", str(tmp_path / "laya.toml")],
            capture_output=True, text=True, check=True).stdout)
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        results, health = asyncio.run(load(server.url))
        sampler.running = False
        sampler.join()
        ready = httpx.get(f"{server.url}/ready").json()
    finally:
        assert server.stop() == 0, server.log()

    statuses = [status for status, _, _ in results]
    completed = [finish for status, finish, _ in results if status == 200]
    refused = [(status, retry) for status, _, retry in results if status != 200]
    print(f"\nplan total {plan['total_bytes'] / 2**20:.1f} MiB, peak RSS "
          f"{sampler.peak / 2**20:.1f} MiB ({sampler.peak / plan['total_bytes']:.1%} of plan); "
          f"200: {len(completed)}, 429: {statuses.count(429)}, 503: {statuses.count(503)}; "
          f"/health max {max(health) * 1000:.0f} ms over {len(health)} probes")
    assert sampler.peak <= plan["total_bytes"] * (1 + TOLERANCE), \
        [(pid, cmd, f"{rss / 2**20:.1f} MiB") for pid, cmd, rss in sampler.at_peak]
    assert set(statuses) <= {200, 429, 503}
    assert all(finish in ("length", "stop") for finish in completed)
    assert len(completed) >= 4 and statuses.count(429) > 0
    assert all(retry for _, retry in refused), "a refusal without Retry-After"
    (replica,) = ready["replicas"]
    assert replica["kv_cache_used_tokens"] == 0 and replica["running"] == 0
    assert replica["waiting"] == 0
    assert replica["rejections"]["queue_full"] == statuses.count(429)
    assert replica["rejections"]["queue_timeout"] == statuses.count(503)
