"""How many conversations a server keeps cached: issue 13's measurement, repeatable.

Starts ``laya serve`` on the embedded model (4 sequences, a 16,384-token pool by default),
sends N conversations of about 350 prompt tokens one after another, then each conversation
again with one more user turn, and prints per revisit the prompt tokens whose KV came from
the cache (the replica's ``prefix_cache_tokens_reused`` on /ready, before and after) and its
latency. Usage: ``python tools/measure_prefix_reuse.py [--conversations 12] [--port 8791]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import benchmark_rounds as rounds  # noqa: E402 - beside this file

WORDS = ("river stone lantern orchard quiet market signal harbor violet copper meadow "
         "engine winter candle bridge paper falcon garden thunder mirror").split()


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def reused(base: str) -> int:
    return sum(r["prefix_cache_tokens_reused"] for r in get(f"{base}/ready")["replicas"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    server = rounds.Server(
        "laya", [sys.executable, "-m", "laya_core.cli.main", "serve",
                 "embedded:smollm2-135m-instruct", "--max-num-seqs", str(args.max_num_seqs),
                 "--port", str(args.port)], "/ready", args.port)
    proc = server.start(Path(tempfile.mkdtemp()) / "laya.log", timeout_s=300)
    try:
        rng = random.Random(13)
        chats = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(300))}]
                 for _ in range(args.conversations)]
        prompt_tokens = []
        for chat in chats:
            out = post(f"{base}/v1/chat/completions", {
                "model": "smollm2-135m-instruct", "messages": chat, "max_tokens": 8,
                "temperature": 0})
            prompt_tokens.append(out["usage"]["prompt_tokens"])
            chat += [out["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        print(f"{args.conversations} conversations, prompt tokens "
              f"{min(prompt_tokens)}-{max(prompt_tokens)} (total {sum(prompt_tokens)})")
        hits = 0
        for i, chat in enumerate(chats):
            before, start = reused(base), time.perf_counter()
            out = post(f"{base}/v1/chat/completions", {
                "model": "smollm2-135m-instruct", "messages": chat, "max_tokens": 8,
                "temperature": 0})
            took, got = time.perf_counter() - start, reused(base) - before
            # The chat template's system prompt is common to all: count a revisit as a hit
            # only when it found most of its own first turn.
            hits += got >= prompt_tokens[i] // 2
            print(f"revisit {i:2d}: {out['usage']['prompt_tokens']:4d} prompt tokens, "
                  f"{got:4d} from the cache, {took * 1000:6.0f} ms")
        print(f"revisits that reused their conversation: {hits} of {len(chats)}")
    finally:
        rounds.stop(proc)


if __name__ == "__main__":
    main()
