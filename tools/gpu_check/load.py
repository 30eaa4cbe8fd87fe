"""Decode throughput of an OpenAI-compatible server: streamed completions, a fixed number in
flight, each generating exactly ``max_tokens`` (``ignore_eos``: a random model would stop at
whatever end token it happens to pick).

Per level: ``output_tokens_per_s``, every token of the level over its wall time (prefill and
queueing in); ``e2e_p50_s``, the median stream's time from request to its end (what
throughput.py turns into a decode rate, as it does transformers' ``generate``: the time
N tokens take beyond 1); ``stream_decode_tokens_per_s``, the median stream's tokens after
its first over the time from its first text to its last (inflated where the server sends
several tokens in one chunk); and the median time to the first text.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]
                     ) -> dict[str, Any]:
    """One streamed completion: its tokens (from the usage chunk), time to the first text,
    and the first and last token times (s, from the request)."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                last = time.perf_counter() - start
                first = last if first is None else first
    if first is None or last is None:
        raise RuntimeError("the stream held no text")
    return {"tokens": tokens, "first_s": first, "last_s": last,
            "end_s": time.perf_counter() - start}


async def level(url: str, model: str, prompts: list[str], *, concurrency: int,
                requests: int, max_tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """``requests`` streams, ``concurrency`` in flight at once; their rates."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    queue = list(range(requests))
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_stream(client, url + "/v1/completions",
                                                {**body, "prompt": prompts[i % len(prompts)]}))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    decode = [(r["tokens"] - 1) / (r["last_s"] - r["first_s"]) for r in results
              if r["tokens"] > 1 and r["last_s"] > r["first_s"]]
    short = [r["tokens"] for r in results if r["tokens"] != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} of {requests} streams ended early ({short[:5]} "
                           f"tokens, not {max_tokens}): is ignore_eos honoured?")
    return {"concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
            "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1),
            "e2e_p50_s": round(statistics.median(r["end_s"] for r in results), 4),
            "stream_decode_tokens_per_s": round(statistics.median(decode), 1) if decode
            else None,
            "ttft_p50_ms": round(1000 * statistics.median(r["first_s"] for r in results), 1)}


def run_level(url: str, model: str, prompts: list[str], **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(level(url, model, prompts, **kwargs))
