"""Time routing decisions the way the HTTP layer makes them: many Python threads, one router.

    python tools/benchmark_router.py --requests 10000 --threads 8
    python tools/benchmark_router.py --requests 10000 --threads 64 --impl both --policy session

Builds N synthetic requests (three models, one asked for by an alias, 2,000 session ids, prompt
prefixes of 3 to 8 block hashes sharing a system prompt per model), splits them over T threads,
and times each ``route()`` alone with ``time.perf_counter_ns``; the request is released right
after. Prints avg, p50, p99 and p99.9 in microseconds and decisions per second (requests over
the wall time of the whole run, releases included). ``--impl both`` runs the Python reference
first, then the C++ router, and reports the speed-up. The last line is JSON for the last
router run, with keys impl, threads, requests, policy, avg_us, p50_us, p99_us, p999_us,
decisions_per_s (and speedup_vs_python after ``--impl both``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from laya_core.kv.hashing import prefix_hashes
from laya_core.routing.router import POLICIES, PythonRouter, Router

# (model, replicas, aliases)
MODELS = (
    ("llama-3.1-8b-instruct", 4, ("llama3",)),
    ("qwen2.5-7b-instruct", 2, ()),
    ("smollm2-135m-instruct", 2, ("smollm2",)),
)
NUM_SESSIONS = 2_000
SYSTEM_BLOCKS = 2  # blocks of 16 tokens of system prompt, shared by a model's conversations
CONVERSATION_BLOCKS = 6
NO_SESSION_SHARE = 0.1  # requests that carry no session id (plain completions)

Request = tuple[str, str | None, tuple[int, ...]]


def make_requests(num_requests: int, seed: int = 0) -> list[Request]:
    """Requests for random sessions; a session's next turn carries one more prefix block."""
    rng = random.Random(seed)
    system = {
        name: [rng.randrange(49_152) for _ in range(16 * SYSTEM_BLOCKS)] for name, _, _ in MODELS
    }
    sessions = []
    for _ in range(NUM_SESSIONS):
        name, _, aliases = rng.choice(MODELS)
        tokens = system[name] + [rng.randrange(49_152) for _ in range(16 * CONVERSATION_BLOCKS)]
        asked_for = rng.choice((name, *aliases))
        sessions.append((asked_for, f"user-{rng.getrandbits(96):024x}", prefix_hashes(tokens)))
    turns = [0] * NUM_SESSIONS
    requests: list[Request] = []
    for _ in range(num_requests):
        index = rng.randrange(NUM_SESSIONS)
        model, session, hashes = sessions[index]
        turns[index] += 1
        length = SYSTEM_BLOCKS + min(turns[index], CONVERSATION_BLOCKS)
        requests.append((model, None if rng.random() < NO_SESSION_SHARE else session,
                         hashes[:length]))
    return requests


def make_router(impl: str, policy: str) -> Router:
    if impl == "cpp":
        from laya_router import CppRouter

        router: Router = CppRouter()
    else:
        router = PythonRouter()
    replica = 0
    for name, num_replicas, aliases in MODELS:
        for _ in range(num_replicas):
            router.add_replica(name, replica)
            replica += 1
        for alias in aliases:
            router.add_alias(alias, name)
        router.set_policy(name, policy)
    return router


def timed_routes(router: Router, requests: Sequence[Request], barrier: threading.Barrier,
                 results: list[list[int]]) -> None:
    route, release, clock = router.route, router.release, time.perf_counter_ns
    latencies_ns = []
    barrier.wait()
    for model, session, prefix in requests:
        start = clock()
        replica = route(model, session, prefix)
        latencies_ns.append(clock() - start)
        release(replica)
    results.append(latencies_ns)


def run(impl: str, policy: str, num_requests: int, num_threads: int) -> dict[str, Any]:
    router = make_router(impl, policy)
    requests = make_requests(num_requests)
    for model, session, prefix in requests[:1_000]:  # warm-up: memory, caches, tables
        router.release(router.route(model, session, prefix))
    results: list[list[int]] = []
    barrier = threading.Barrier(num_threads + 1)
    threads = [
        threading.Thread(target=timed_routes,
                         args=(router, requests[i::num_threads], barrier, results))
        for i in range(num_threads)
    ]
    for thread in threads:
        thread.start()
    gc.collect()
    gc.freeze()  # the collector need not walk the workload while threads run
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    gc.unfreeze()
    return summarize(impl, policy, num_threads, sorted(x for r in results for x in r), wall_s)


def summarize(impl: str, policy: str, num_threads: int, latencies_ns: list[int],
              wall_s: float) -> dict[str, Any]:
    def percentile_us(fraction: float) -> float:  # nearest rank
        rank = max(1, math.ceil(fraction * len(latencies_ns)))
        return round(latencies_ns[rank - 1] / 1_000, 3)

    return {
        "impl": impl,
        "threads": num_threads,
        "requests": len(latencies_ns),
        "policy": policy,
        "avg_us": round(sum(latencies_ns) / len(latencies_ns) / 1_000, 3),
        "p50_us": percentile_us(0.50),
        "p99_us": percentile_us(0.99),
        "p999_us": percentile_us(0.999),
        "decisions_per_s": round(len(latencies_ns) / wall_s),
    }


def report(result: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(f"{result['impl']} router, policy {result['policy']}, {result['threads']} threads, "
        f"{result['requests']} requests")
    out(f"  avg {result['avg_us']:.2f} us   p50 {result['p50_us']:.2f} us   "
        f"p99 {result['p99_us']:.2f} us   p99.9 {result['p999_us']:.2f} us   "
        f"{result['decisions_per_s']:,} decisions/s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests in all")
    parser.add_argument("--threads", type=int, default=8, help="Python threads routing")
    parser.add_argument("--impl", choices=("cpp", "python", "both"), default="cpp")
    parser.add_argument("--policy", choices=POLICIES, default="prefix")
    args = parser.parse_args(argv)
    if args.requests < args.threads or args.threads < 1:
        parser.error("need --threads >= 1 and --requests >= --threads")
    impls = ("python", "cpp") if args.impl == "both" else (args.impl,)
    results = [run(impl, args.policy, args.requests, args.threads) for impl in impls]
    for result in results:
        report(result)
    last = results[-1]
    if len(results) == 2:
        last["speedup_vs_python"] = round(results[0]["avg_us"] / last["avg_us"], 1)
        print(f"cpp is {last['speedup_vs_python']}x faster than python (avg per decision)")
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
