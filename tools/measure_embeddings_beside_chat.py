"""How embeddings and generation share a replica: issue 25 item 7's measurement, repeatable.

Starts ``laya serve`` on the embedded model with embeddings on (a worker process, as by
default), then prints:

1. a short chat (``--chat-tokens``, 4) alone: its time to first token and total;
2. the same chat sent once a large embed request (``--inputs`` x ``--tokens``, 200 x 1,000)
   has begun: the chat's times, and the embed request's;
3. the large request again, its client gone after ``--leave-after`` seconds: a chat right
   after, and whether the replica went on embedding (``embedded_tokens`` on /ready, where
   the server has it);
4. 2,048 one-token inputs in one request.

Usage: ``python tools/measure_embeddings_beside_chat.py [--inputs 200] [--tokens 1000]
[--max-step-tokens 512] [--port 8792] [--engine process]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import benchmark_rounds as rounds  # noqa: E402 - beside this file

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}
[cluster]
engine = "{engine}"
[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = {max_seq_len}
max_num_seqs = 8
max_step_tokens = {max_step_tokens}
embeddings = true
"""


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def embedded(base: str) -> int | None:
    replicas = get(f"{base}/ready")["replicas"]
    return replicas[0].get("embedded_tokens")


def chat(base: str, tokens: int) -> tuple[float, float]:
    """A streamed chat's (time to first token, total), in seconds."""
    body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": tokens,
                       "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    req = urllib.request.Request(f"{base}/v1/chat/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if first is None and b'"content"' in line:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


def inputs(num: int, tokens: int) -> list[list[int]]:
    return [[1000 + (7 * i + 13 * j) % 20000 for j in range(tokens)] for i in range(num)]


def wait_until_embedding(base: str, before: int | None, fallback_s: float = 2.0) -> None:
    if before is None:  # a server without the counter: give it a moment to begin
        time.sleep(fallback_s)
        return
    while (embedded(base) or 0) <= before:
        time.sleep(0.05)


def leave_after(base: str, port: int, body: bytes, seconds: float) -> None:
    """Send an embed request and close the connection ``seconds`` later."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(seconds)
    sock.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--chat-tokens", type=int, default=4)
    ap.add_argument("--leave-after", type=float, default=20.0)
    ap.add_argument("--port", type=int, default=8792)
    ap.add_argument("--engine", default="process", choices=("process", "thread"))
    ap.add_argument("--max-step-tokens", type=int, default=512)
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    work = Path(tempfile.mkdtemp())
    (work / "laya.toml").write_text(MANIFEST.format(
        port=args.port, engine=args.engine, max_seq_len=max(1024, args.tokens),
        max_step_tokens=args.max_step_tokens))
    server = rounds.Server("laya", [sys.executable, "-m", "laya_core.cli.main", "serve",
                                    str(work / "laya.toml")], "/ready", args.port)
    proc = server.start(work / "laya.log", timeout_s=600)
    try:
        big = {"model": "smollm2", "input": inputs(args.inputs, args.tokens)}
        chat(base, args.chat_tokens)  # warm
        alone = [chat(base, args.chat_tokens) for _ in range(3)]
        print("chat alone: TTFT " + ", ".join(f"{t:.2f}" for t, _ in alone)
              + " s; total " + ", ".join(f"{s:.2f}" for _, s in alone) + " s")

        took: dict[str, float] = {}

        def embed() -> None:
            start = time.perf_counter()
            post(f"{base}/v1/embeddings", big)
            took["embed"] = time.perf_counter() - start

        before = embedded(base)
        worker = threading.Thread(target=embed)
        worker.start()
        wait_until_embedding(base, before)
        ttft, total = chat(base, args.chat_tokens)
        worker.join()
        print(f"chat beside {args.inputs} x {args.tokens} tokens: TTFT {ttft:.2f} s, total "
              f"{total:.2f} s; the embed request {took['embed']:.1f} s")

        before = embedded(base)
        body = json.dumps(big).encode()
        leave_after(base, args.port, body, args.leave_after)
        ttft, total = chat(base, args.chat_tokens)
        at_chat = embedded(base)
        time.sleep(5)
        later = embedded(base)
        went_on = "unknown (no counter)" if later is None else \
            f"{later - (at_chat or 0)} tokens in the 5 s after the chat" + \
            f" ({(at_chat or 0) - (before or 0)} before it)"
        print(f"client gone after {args.leave_after:g} s: a chat then TTFT {ttft:.2f} s, total "
              f"{total:.2f} s; the replica embedded {went_on}")

        start = time.perf_counter()
        post(f"{base}/v1/embeddings", {"model": "smollm2", "input": [[t] for t in
                                                                     range(1000, 3048)]})
        print(f"2,048 one-token inputs: {time.perf_counter() - start:.1f} s")
    finally:
        rounds.stop(proc)


if __name__ == "__main__":
    main()
