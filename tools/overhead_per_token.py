"""Laya's own work per streamed token: a real server whose backend answers instantly.

    python tools/overhead_per_token.py --engine process --requests 10 --max-tokens 480 \\
        --step-ms 5

With the model's compute taken out, what a token still costs is Laya's: the engine loop,
scheduling, detokenizing, the hand-over, the worker's message, the front end's receive and
the SSE chunk. The program starts ``laya serve``'s code (a worker process by default) with
an instant backend defined here (each step returns the letter ``a`` for every sequence,
after ``--step-ms`` of sleep: a model's step time without its CPU, so that each step's
events leave in a message of their own as with a real model, instead of several steps'
together), streams completions one at a time from another process, and prints the CPU
time the server's whole process tree spent per token (``/proc``, through psutil), the wall
time per token the client saw, each layer's share from ``/metrics``, and the CPU each thread
spent per token, by the names Laya gives its threads (``profile_token.thread_cpu_s``). The client runs in
its own process, so its work is not counted.

On a machine with two cores this is the number that matters for concurrency 1: the model's
threads want both cores, and whatever Laya runs beside them is taken from them. Its last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))
sys.path.append(str(TESTS))  # last: tests/laya_core must not stand in for laya_core

from toy_backend import END, ToyTokenizer  # noqa: E402 - the test suite's byte tokenizer

from laya_core.backend import Backend, ModelInfo, StepItem, StepResult  # noqa: E402
from laya_core.hookspecs import hookimpl  # noqa: E402
from laya_core.types import Sample, SamplingParams  # noqa: E402

LETTER = ord("a")


class InstantBackend(Backend):
    """A backend with no model: every sampling row says ``a``."""

    name = "instant"
    kv_layout = "paged"
    option_names = frozenset({"step_ms"})

    def load_weights(self) -> ModelInfo:
        return ModelInfo(n_ctx_train=4096, vocab_size=257, eog_token_ids=frozenset({END}),
                         chat_template=None, bos_token="", eos_token="", add_bos=False)

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        pass

    def tokenizer(self) -> ToyTokenizer:
        return ToyTokenizer()

    def load_tokenizer(self) -> ToyTokenizer:
        return ToyTokenizer()

    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        pass

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        time.sleep(self.config.options.get("step_ms", 0) / 1000)  # no CPU, no GIL
        return [StepResult(Sample(LETTER) if item.sample else None) for item in items]

    def free_sequence(self, seq_id: int) -> None:
        pass


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("instant", InstantBackend)


PLUGIN = Plugin()


def serve(port: int, engine: str, workdir: Path, step_ms: float) -> int:
    """The server side (this program run again with ``--serve``)."""
    from laya_core.cli.serve import serve as laya_serve
    from laya_core.config import manifest as mf
    from laya_core.logs import setup_logging
    from laya_core.plugins import load_registry

    setup_logging()
    weights = workdir / "instant.bin"  # a path the manifest can check; nothing reads it
    weights.write_bytes(b"")
    registry = load_registry([PLUGIN])
    manifest = mf.resolve(mf.from_dict({
        "server": {"host": "127.0.0.1", "port": port}, "cluster": {"engine": engine},
        "models": [{"name": "instant", "backend": "instant", "path": str(weights),
                    "max_seq_len": 4096, "options": {"step_ms": step_ms}}]}), registry)
    return laya_serve(manifest, registry, worker_plugins=["overhead_per_token:PLUGIN"])


def layer_ms(url: str) -> dict[str, float]:
    """Seconds per layer so far, and the generated tokens, from /metrics."""
    sys.path.insert(0, str(TOOLS))
    from profile_token import counters

    return counters(httpx.get(url + "/metrics").text, "instant")


def stream(url: str, requests: int, max_tokens: int) -> int:
    """Streamed completions one after another; the SSE chunks with a token received."""
    chunks = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(requests):
            body = {"model": "instant", "prompt": "hi", "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                chunks += sum(1 for line in r.iter_lines() if line.startswith('data: {"'))
    return chunks


def client_main(args: argparse.Namespace) -> dict[str, Any]:
    import profile_token  # beside this file
    from benchmark_rounds import _free_port

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="laya-overhead-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(TOOLS), *filter(None, [os.environ.get("PYTHONPATH")]), str(TESTS)])}
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--serve", str(port),
                             "--engine", args.engine, "--workdir", str(workdir),
                             "--step-ms", str(args.step_ms)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {workdir / 'server.log'}")
            time.sleep(0.1)
        tree = psutil.Process(proc.pid)

        def cpu_s() -> float:
            total = 0.0
            for p in [tree, *tree.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
            return total

        stream(url, 2, 32)  # warm up
        threads0 = profile_token.thread_cpu_s(tree)
        before, cpu0, wall0 = layer_ms(url), cpu_s(), time.perf_counter()
        chunks = stream(url, args.requests, args.max_tokens)
        wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
        threads = profile_token.thread_cpu_s(tree)
        time.sleep(0.6)  # the worker's last step message is counted in its next state
        after = layer_ms(url)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    tokens = after["tokens"] - before["tokens"]
    layers = {k: round((after[k] - before.get(k, 0.0)) / tokens * 1e6, 1)
              for k in after if k not in ("tokens", "steps")}
    per_thread = profile_token.thread_cpu_spent(threads0, threads)
    return {"engine": args.engine, "step_ms": args.step_ms, "tokens": int(tokens),
            "chunks": chunks,
            "server_cpu_us_per_token": round(cpu / tokens * 1e6, 1),
            "wall_us_per_token": round(wall / tokens * 1e6, 1),
            "layers_us_per_token": layers,
            "threads_cpu_us_per_token": {
                name: round(seconds / tokens * 1e6, 1) for name, seconds in
                sorted(per_thread.items(), key=lambda kv: -kv[1]) if seconds > 0}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="process", choices=("process", "thread"))
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=480)
    p.add_argument("--step-ms", type=float, default=5.0,
                   help="each step's sleep (0: as fast as Laya goes, several steps a message)")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args.engine, args.workdir, args.step_ms)
    sys.path.insert(0, str(TOOLS))
    result = client_main(args)
    print(f"{result['engine']}, steps of {result['step_ms']} ms: {result['tokens']} tokens, "
          "server CPU "
          f"{result['server_cpu_us_per_token']} us/token, wall {result['wall_us_per_token']}"
          " us/token")
    for name, us in result["layers_us_per_token"].items():
        print(f"  {name:<12} {us:8.1f} us/token")
    print("  CPU by thread:")
    for name, us in result["threads_cpu_us_per_token"].items():
        print(f"  {name:<24} {us:8.1f} us/token")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
