"""How long a model loaded on demand takes from its request to its first token.

    python tools/cold_start.py --rounds 5 --backends llamacpp torch

Starts one ``laya serve`` (worker processes, as it serves by default) with the embedded
model once per backend, each ``load = "on_demand"``, and then, in alternating rounds, for
each backend: unloads its model (``POST /models/unload``: its worker exits), sends one
streamed chat completion, and records the time from sending to the first token, the
``load`` layer the server reports for that request (its replicas' start to ready), and the
same request again with the model loaded (the first token without a load). The model file
stays in the page cache between rounds, as it does on a machine that swaps models; the
first round's load may include reading it from disk.

Prints a line per round and backend, then a summary per backend (median of the rounds) and,
last, the same as JSON with the machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Say hello."}]


def manifest(port: int, backends: list[str]) -> str:
    entries = "".join(f"""
[[models]]
name = "{b}"
backend = "{b}"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 1024
max_num_seqs = 4
load = "on_demand"
""" for b in backends)
    return f'[server]\nhost = "127.0.0.1"\nport = {port}\naccess_log = false\n' + entries


def first_token(url: str, model: str) -> tuple[float, float]:
    """(seconds to the first token, the server's load layer in seconds) of one request."""
    start = time.perf_counter()
    first = None
    load_ms = 0.0
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - start
            load_ms = chunk.get("laya_timing", {}).get("load_ms", load_ms)
    assert first is not None, "no token came"
    return first, load_ms / 1000


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["llamacpp", "torch"])
    parser.add_argument("--port", type=int, default=18731)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "laya.toml"
        path.write_text(manifest(args.port, args.backends))
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115 - closed below
        server = subprocess.Popen([sys.executable, "-m", "laya_core.cli.main", "serve",
                                   str(path)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    print((Path(tmp) / "server.log").read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.1)
            results: dict[str, list[dict[str, float]]] = {b: [] for b in args.backends}
            for round_ in range(args.rounds):
                order = args.backends if round_ % 2 == 0 else args.backends[::-1]
                for backend in order:
                    httpx.post(f"{url}/models/unload", json={"model": backend}, timeout=300)
                    cold, load_s = first_token(url, backend)
                    warm, _ = first_token(url, backend)
                    row = {"first_token_s": cold, "load_s": load_s, "loaded_first_token_s": warm}
                    results[backend].append(row)
                    print(f"round {round_ + 1} {backend:9} first token {cold * 1000:7.0f} ms "
                          f"(load {load_s * 1000:6.0f} ms); loaded: {warm * 1000:6.0f} ms",
                          flush=True)
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    summary: dict[str, Any] = {"cpu": cpu_name(), "rounds": args.rounds, "backends": {}}
    for backend, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        summary["backends"][backend] = {**med, "rounds": rows}
        print(f"{backend:9} median: first token {med['first_token_s'] * 1000:.0f} ms after an "
              f"unload (load {med['load_s'] * 1000:.0f} ms), "
              f"{med['loaded_first_token_s'] * 1000:.0f} ms loaded  [{summary['cpu']}]")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
