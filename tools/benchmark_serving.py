"""Load generator for any OpenAI-compatible chat endpoint: Laya, llama-server, vLLM, ...

    python tools/benchmark_serving.py --url http://127.0.0.1:8000 --model smollm2 \\
        --concurrency 1,4,8 --requests 32 --max-tokens 64 --out results/smollm2

Each concurrency level is one run that keeps exactly that many streamed chat completions in
flight until ``--requests`` have finished. Per request it measures the time to the first
content chunk (TTFT), the gaps between content chunks (ITL), the end-to-end time and the
output tokens (from the usage chunk when the server sends one, else one per content chunk),
and from those the time per output token after the first (TPOT) and the decode tokens/s, the
part of a request that speculative decoding speeds up (several tokens can share one chunk,
so ITL alone does not show it).
It prints a table, writes ``OUT.json`` (every level plus the raw numbers of every request) and
``OUT.png`` (needs matplotlib), and prints a one-line JSON summary as its last line.
Exit status: 0, or 1 when every request failed, or 2 for bad arguments.

It sends traffic only to ``--url``; every request is bounded by ``--timeout``. Only httpx is
needed, so it runs outside Laya's environment too (hence dataclasses rather than attrs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The prompt sets live beside this file; the directory is put on the path so that this
# module also imports when loaded by path (tests, other tools).
sys.path.insert(0, str(Path(__file__).parent))
from benchmark_prompts import PROMPT_SETS  # noqa: E402


class StreamProblem(Exception):
    """The response was not a well-formed stream; ``kind`` is bad_stream or stream_error."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(slots=True)
class RequestResult:
    """One request's numbers; seconds throughout."""

    index: int
    prompt_index: int
    ok: bool = False
    error: str | None = None  # http_<status>, timeout, connection, bad_stream or stream_error
    detail: str | None = None
    ttft_s: float | None = None  # None when no content came back
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_chunks: int = 0  # content chunks received
    finish_reason: str | None = None  # None on an ok request: the server cut the stream short
    output_tokens: int = 0
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None without a first token and a second."""
        if self.ttft_s is None or self.output_tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _v1(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _chat_url(url: str) -> str:
    return _v1(url) + "/chat/completions"


def _models_url(url: str) -> str:
    return _v1(url) + "/models"


def _parse_event(event: Any, result: RequestResult) -> bool:
    """Record usage and finish_reason from one SSE event; whether it carried content."""
    if not isinstance(event, dict):
        raise StreamProblem("bad_stream", f"event is not a JSON object: {event!r:.200}")
    if "error" in event:
        raise StreamProblem("stream_error", json.dumps(event["error"])[:300])
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens, result.tokens_from_usage = usage["completion_tokens"], True
        result.prompt_tokens = usage.get("prompt_tokens")
    has_content = False
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            raise StreamProblem("bad_stream", f"a choice is not a JSON object: {choice!r:.200}")
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking separately; it is generated output all the same.
        has_content = has_content or bool(delta.get("content") or delta.get("reasoning_content"))
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return has_content


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> None:
    last: float | None = None  # arrival of the previous content chunk (perf_counter s)
    async for line in response.aiter_lines():
        now = time.perf_counter()  # before parsing: the arrival is what is measured
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments, event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise StreamProblem("bad_stream", f"data is not JSON: {data[:200]!r}") from None
        if _parse_event(event, result):
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_chunks += 1
    if result.finish_reason is None:  # some servers omit [DONE]; a finish_reason is enough
        raise StreamProblem("bad_stream", "the stream ended before [DONE] or a finish_reason")


async def run_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      result: RequestResult, timeout_s: float) -> None:
    """Send one streamed request and fill ``result``; never raises for a failed request."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error, result.detail = f"http_{response.status_code}", text[:300]
            else:
                await _read_stream(response, result, start)
                result.ok = True
    except (TimeoutError, httpx.TimeoutException) as e:
        result.error = "timeout"
        result.detail = f"no complete answer within {timeout_s:g} s ({type(e).__name__})"
    except httpx.TransportError as e:  # refused, reset, closed mid-stream
        result.error, result.detail = "connection", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:  # undecodable body and the like
        result.error, result.detail = "bad_stream", f"{type(e).__name__}: {e}"
    except StreamProblem as e:
        result.error, result.detail = e.kind, str(e)
    result.e2e_s = time.perf_counter() - start
    if not result.tokens_from_usage:
        result.output_tokens = result.num_chunks


def request_body(args: argparse.Namespace, model: str, prompt: str, index: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": args.seed + index, "stream": True, "stream_options": {"include_usage": True}}


async def run_level(args: argparse.Namespace, model: str,
                    concurrency: int) -> tuple[list[RequestResult], float]:
    """All of a level's requests, ``concurrency`` in flight; the results and the wall time (s)."""
    prompts = PROMPT_SETS[args.prompt_set]
    rng = random.Random(args.seed)  # the same prompt sequence at every level
    results = [RequestResult(i, rng.randrange(len(prompts))) for i in range(args.requests)]
    pending = iter(results)  # shared by the workers: each takes the next request when free
    url = _chat_url(args.url)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=_headers(args), limits=limits,
                                 timeout=args.timeout) as client:
        async def worker() -> None:
            for r in pending:
                body = request_body(args, model, prompts[r.prompt_index], r.index)
                await run_request(client, url, body, r, args.timeout)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def first_model(args: argparse.Namespace) -> str:
    """The first model that GET /v1/models lists, for when --model is not given.

    Raises LookupError saying why there is none.
    """
    url = _models_url(args.url)
    try:
        async with httpx.AsyncClient(headers=_headers(args), timeout=args.timeout) as client:
            data = (await client.get(url)).raise_for_status().json().get("data") or []
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, LookupError, AttributeError, TypeError) as e:
        raise LookupError(f"no --model given and GET {url} named none "
                          f"({type(e).__name__}: {e}); pass --model") from None


def percentiles(values: list[float], ps: tuple[int, ...]) -> dict[str, float | None]:
    """Linear-interpolated percentiles of seconds, in ms; None for no values."""
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = None
            continue
        k = (len(xs) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        out[f"p{p}"] = round((xs[lo] + (xs[hi] - xs[lo]) * (k - lo)) * 1000, 3)
    return out


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    num_tokens = sum(r.output_tokens for r in ok)  # failed requests' partial output not counted
    return {
        "concurrency": concurrency, "requests": len(results), "ok": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(Counter(r.error for r in results if r.error).items())),
        "finish_reasons": dict(sorted(Counter(str(r.finish_reason or "none") for r in ok).items())),
        "wall_s": round(wall_s, 3), "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 90, 99)),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s], (50, 99)),
        "e2e_ms": percentiles([r.e2e_s for r in ok], (50, 99)),
        # After the first token: what speculative decoding changes (the prompt's prefill is
        # in TTFT). TPOT as vLLM's benchmark defines it, per request: (E2E - TTFT) / (tokens
        # - 1); decode tokens/s, the same over all requests, is tokens after the first per
        # second of those stretches: at concurrency 1 the throughput, above it the rate one
        # stream sees (the stretches overlap).
        "tpot_ms": percentiles([r.tpot_s for r in ok if r.tpot_s is not None], (50, 99)),
        "decode_tokens_per_s": decode_rate(ok),
    }


def decode_rate(results: list[RequestResult]) -> float | None:
    """Tokens after each request's first, per second from its first token to its end; None
    when no request had two tokens."""
    timed = [r for r in results if r.tpot_s is not None]
    seconds = sum(r.e2e_s - (r.ttft_s or 0.0) for r in timed)
    return round(sum(r.output_tokens - 1 for r in timed) / seconds, 2) if seconds > 0 else None


COLUMNS = ("conc", "ok", "fail", "tok/s", "req/s", "TTFT p50", "p90", "p99",
           "ITL p50", "p99", "TPOT p50", "E2E p50", "p99", "errors")


def table_row(level: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"
    t, i, e = level["ttft_ms"], level["itl_ms"], level["e2e_ms"]
    cells = (level["concurrency"], level["ok"], level["failed"], level["output_tokens_per_s"],
             level["requests_per_s"], ms(t["p50"]), ms(t["p90"]), ms(t["p99"]), ms(i["p50"]),
             ms(i["p99"]), ms(level["tpot_ms"]["p50"]), ms(e["p50"]), ms(e["p99"]),
             " ".join(f"{k}={v}" for k, v in level["errors"].items()) or "-")
    return "  ".join(f"{c!s:>8}" for c in cells[:-1]) + f"  {cells[-1]}"


def write_plot(levels: list[dict[str, Any]], title: str, path: Path) -> bool:
    """Throughput and TTFT p50 against concurrency; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [lv["output_tokens_per_s"] for lv in levels], marker="o")
    left.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    right.plot(x, [lv["ttft_ms"]["p50"] for lv in levels], marker="o", color="tab:orange")
    right.set(xlabel="concurrency", ylabel="ms", title="TTFT p50")
    for ax in (left, right):
        ax.set_xticks(x)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _output_paths(out: str) -> tuple[Path, Path]:
    p = Path(out)
    base = p.with_suffix("") if p.suffix == ".json" else p
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".png")


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _levels(text: str) -> list[int]:
    return [_positive(part) for part in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="base URL, with or without /v1")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=_levels, default=[1],
                   help="requests in flight: one value or a list such as 1,4,8,16 (one run each)")
    p.add_argument("--requests", type=_positive, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=_positive, default=64, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default="mixed",
                   help="built-in prompts: short questions, long tasks, both, or copy "
                   "(rewrite a 400-token file with one change)")
    p.add_argument("--seed", type=int, default=0, help="prompt order; request i sends seed+i")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request, in all")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--out", help="write OUT.json and OUT.png (OUT may end in .json)")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        p.error(f"--url must start with http:// or https://, got {args.url!r}")
    return args


async def benchmark(args: argparse.Namespace) -> int:
    try:
        model = args.model or await first_model(args)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        print(json.dumps({"url": args.url, "error": str(e)}))
        return 2
    print("  ".join(f"{c:>8}" for c in COLUMNS[:-1]) + f"  {COLUMNS[-1]}")
    levels, raw = [], []
    for concurrency in args.concurrency:
        results, wall_s = await run_level(args, model, concurrency)
        levels.append(summarize(concurrency, results, wall_s))
        raw.append([asdict(r) for r in results])
        print(table_row(levels[-1]), flush=True)
        if num_cut := levels[-1]["finish_reasons"].get("none"):
            print(f"note: {num_cut} requests ended with [DONE] but no finish_reason: did the "
                  "server cut them short? (llama-cpp-python does unless interrupt_requests=false)")
    config = {"url": args.url, "model": model, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "prompt_set": args.prompt_set,
              "seed": args.seed, "requests_per_level": args.requests, "timeout_s": args.timeout}
    summary: dict[str, Any] = {**config, "levels": levels, "json": None, "plot": None}
    if args.out:
        json_path, png_path = _output_paths(args.out)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        full = {**config, "levels": [{**lv, "raw": r} for lv, r in zip(levels, raw, strict=True)]}
        json_path.write_text(json.dumps(full, indent=1) + "\n")
        summary["json"] = str(json_path)
        title = f"{model} at {args.url}, max_tokens={args.max_tokens}, {args.prompt_set} prompts"
        if write_plot(levels, title, png_path):
            summary["plot"] = str(png_path)
        else:
            print("note: no plot written: it needs matplotlib (pip install matplotlib)")
    print(json.dumps(summary))
    return 1 if all(lv["ok"] == 0 for lv in levels) else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(benchmark(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
