"""Alternating rounds of the serving benchmark against several servers, each started fresh.

    python tools/benchmark_rounds.py --rounds 3 --concurrency 1,8 \\
        --laya defaults --laya 'two-threads:{"n_threads": 2}' \\
        --laya before@/path/to/old-checkout/.venv/bin/python \\
        --llama-server /path/to/llama-server --busy 0

These machines drift 10-15% from minute to minute, so a ratio between two servers is only
worth something when both ran in the same minutes: each round starts every server in turn
(a fresh process, alone on the machine), runs ``benchmark_serving.py`` against it, and stops
it. ``--busy N`` keeps N CPU-bound processes running beside each measurement, the case in
which llama.cpp's threads can collapse. The output is one line per run, then per server and
level the median over the rounds of output tokens/s and TTFT p50, and each round's ratio to
the baseline server (``--baseline``, default the first), of output tokens/s and of decode
tokens/s (after each request's first token, which speculative decoding changes and a
prompt's prefill does not; above concurrency 1, the rate one stream sees); ``--out`` writes
it all as JSON. ``--settle LOAD`` waits before
each run until the load average is under LOAD, so that no run starts in the last one's tail.

Laya serves the embedded model with its own defaults, changed only by the spec's JSON: a
``"backend"`` key picks the backend (``--laya 'torch:{"backend": "torch"}'``), an
``"engine"`` key ``[cluster] engine`` (``--laya 'threads:{"engine": "thread"}'``), a
``"path"`` key another model (a GPTQ or AWQ folder of the embedded model, say), the keys of
a ``[[models]]`` table (``max_seq_len``, ``max_num_seqs``, ...) go there, and the rest into
``[models.options]``. Each run records how long its server took to answer ready
(``ready_s``: the process's start and the model's load). llama-server serves the same file
once per ``--llama-config NAME=ARGS``: by default with its true defaults (``llama-defaults``: no flags) and tuned
(``llama-np8``: ``-np 8 -c 16384``); ``--llama-server-common`` adds flags to every one (on a
CPU with AMX, ``--no-repack``: its repacked Q4_1 weights crash there). Each run records the
machine's load average just before it starts; the JSON names the CPU. It sends traffic only
to servers it started on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from laya_core.config import manifest

TOOLS = Path(__file__).parent
LAYA_MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[cluster]
engine = "{engine}"

[[models]]
name = "smollm2"
backend = "{backend}"
path = {path}
{model}
[models.options]
{options}
"""
# A spec's keys that belong to the model's table rather than to its options: the
# manifest's own (laya_core/config/manifest.py), but those the template writes itself.
MODEL_KEYS = frozenset(manifest.MODEL_KEYS) - {"name", "backend", "path", "options"}
LLAMA_CONFIGS = ("llama-defaults=", "llama-np8=-np 8 -c 16384")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):  # an inline table: {"method": "ngram"} -> { method = "ngram" }
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers and booleans are spelt alike in TOML


class Server:
    """One server under test: how to start it and how to know it has loaded."""

    def __init__(self, name: str, argv: list[str], ready_path: str, port: int) -> None:
        self.name, self.argv, self.ready_path, self.port = name, argv, ready_path, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    ready_s: float | None = None  # how long the last start took to answer ready

    def start(self, log: Path, timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            # Run from the log's folder: `python -m` puts the working folder first on
            # sys.path, and this checkout's laya_core must not shadow another install's.
            proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=log.parent)
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.ready_s = round(time.monotonic() - started, 2)
                    return proc
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {log}")


def laya_server(spec: str, workdir: Path) -> Server:
    """``NAME[:OPTIONS_JSON][@PYTHON]``: PYTHON is another install's interpreter (a checkout of
    an older commit with its own venv), to compare two versions of Laya in the same rounds."""
    head, _, python = spec.rpartition("@")
    spec, python = (head, python) if head and python.startswith("/") else (spec, "")
    name, _, options = spec.partition(":")
    table = json.loads(options) if options else {}
    backend = table.pop("backend", "llamacpp")  # the two keys that are not options
    engine = table.pop("engine", "auto")  # [cluster] engine: process, thread
    port = _free_port()
    manifest = workdir / f"{name}.toml"
    model = {k: table.pop(k) for k in list(table) if k in MODEL_KEYS}
    path = table.pop("path", "embedded:smollm2-135m-instruct")  # another model (its folder)
    manifest.write_text(LAYA_MANIFEST.format(
        port=port, backend=backend, engine=engine, path=_toml_value(path),
        model="\n".join(f"{k} = {_toml_value(v)}" for k, v in model.items()),
        options="\n".join(f"{k} = {_toml_value(v)}" for k, v in table.items())))
    argv = [python or sys.executable, "-m", "laya_core.cli.main", "serve", str(manifest)]
    return Server(name, argv, "/ready", port)


def llama_server(binary: str, model: str, config: str, common: str = "") -> Server:
    """``config``: ``NAME=ARGS``, llama-server's flags for this one (none: its defaults)."""
    name, _, extra = config.partition("=")
    port = _free_port()
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(extra), *shlex.split(common)]
    return Server(name or "llama-server", argv, "/health", port)


def machine() -> dict[str, Any]:
    """The CPU the numbers were measured on: its model name, core count and the flags that
    decide llama.cpp's kernels (the ones the llama.cpp backend names at start-up)."""
    from laya_backend_llamacpp.cpu import read_cpuinfo

    host = read_cpuinfo()
    return {"cpu": host.model, "cpus": os.cpu_count(), "flags": host.notable_flags}


def embedded_model() -> str:
    from laya_core.builtin.model_paths import embedded_file

    return embedded_file("smollm2-135m-instruct")


def measure(server: Server, args: argparse.Namespace, log: Path) -> dict[int, dict[str, Any]]:
    """Start the server, keep ``--busy`` spinners beside it, run the benchmark, stop both.
    Each level also carries the load average just before the server started."""
    waited = settle(args.settle, 300.0) if args.settle is not None else 0.0
    load = os.getloadavg()[0]
    proc = server.start(log)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        run = subprocess.run(
            [sys.executable, str(TOOLS / "benchmark_serving.py"), "--url", server.url,
             "--concurrency", args.concurrency, "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--prompt-set", args.prompt_set],
            capture_output=True, text=True, timeout=args.timeout_s, check=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        stop(proc)
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    return {lv["concurrency"]: {**lv, "load_before": round(load, 2), "settled_s": waited,
                                "ready_s": server.ready_s}
            for lv in summary["levels"]}


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server as its service manager would, killing it after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summarize(runs: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Medians per server and level, and round-by-round ratios to the baseline."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        for level, lv in run["levels"].items():
            by.setdefault((run["server"], int(level)), []).append({"round": run["round"], **lv})
    out: dict[str, Any] = {}
    for (server, level), levels in sorted(by.items()):
        base = {lv["round"]: lv for lv in by.get((baseline, level), [])}
        ratios = [round(lv["output_tokens_per_s"] / base[lv["round"]]["output_tokens_per_s"], 3)
                  for lv in levels if lv["round"] in base
                  and base[lv["round"]]["output_tokens_per_s"] > 0]
        out.setdefault(server, {})[str(level)] = {
            "tokens_per_s": [lv["output_tokens_per_s"] for lv in levels],
            "median_tokens_per_s": statistics.median(lv["output_tokens_per_s"] for lv in levels),
            "median_ttft_p50_ms": statistics.median(lv["ttft_ms"]["p50"] or 0 for lv in levels),
            **_decode_ratios(levels, base, baseline),
            "failed": sum(lv["failed"] for lv in levels),
            f"ratio_to_{baseline}": ratios,
            f"median_ratio_to_{baseline}": statistics.median(ratios) if ratios else None,
        }
    return out


def _decode_ratios(levels: list[dict[str, Any]], base: dict[int, dict[str, Any]],
                   baseline: str) -> dict[str, Any]:
    """Decode tokens/s (after each request's first token) per round, and its ratios to the
    baseline's same round; empty for runs that did not record it."""
    rates = [lv.get("decode_tokens_per_s") for lv in levels]
    if any(r is None for r in rates):
        return {}
    ratios = [round(lv["decode_tokens_per_s"] / base[lv["round"]]["decode_tokens_per_s"], 3)
              for lv in levels if lv["round"] in base
              and (base[lv["round"]].get("decode_tokens_per_s") or 0) > 0]
    return {"decode_tokens_per_s": rates,
            f"decode_ratio_to_{baseline}": ratios,
            f"median_decode_ratio_to_{baseline}": statistics.median(ratios) if ratios else None}


def settle(below: float, limit_s: float, loadavg: Any = os.getloadavg,
           sleep: Any = time.sleep) -> float:
    """Wait until the 1-minute load average is under ``below`` (the last run's tail decays
    with a 1-minute time constant), at most ``limit_s``; the seconds waited."""
    waited = 0.0
    while loadavg()[0] >= below and waited < limit_s:
        sleep(5.0)
        waited += 5.0
    return waited


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--laya", action="append", default=[], metavar="NAME[:OPTIONS_JSON][@PYTHON]",
                   help="a Laya server with these [models.options] (a \"backend\" key picks "
                   "the backend, default llamacpp), run by PYTHON (default: this "
                   "interpreter's install); repeat to compare several")
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's server binary")
    p.add_argument("--llama-config", action="append", metavar="NAME=ARGS",
                   help="a llama-server configuration (repeatable; default: "
                   + ", ".join(repr(c) for c in LLAMA_CONFIGS) + ")")
    p.add_argument("--llama-server-common", default="", metavar="ARGS",
                   help="flags for every llama-server configuration (e.g. --no-repack)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,8", help="levels, as for benchmark_serving.py")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-set", default="mixed", help="benchmark_serving.py's prompts "
                   "(copy: rewrite a file with one change, where prompt lookup helps)")
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside each run")
    p.add_argument("--settle", type=float, metavar="LOAD",
                   help="before each run, wait (up to 5 minutes) until the 1-minute load "
                   "average is under LOAD, for measurements on a quiet machine")
    p.add_argument("--baseline", help="the server the ratios are to (default: the first)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark run")
    p.add_argument("--out", type=Path, help="write the runs and the summary as JSON here")
    args = p.parse_args(argv)
    if not args.laya and not args.llama_server:
        p.error("name at least one server: --laya NAME or --llama-server PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="laya-rounds-"))
    servers = [laya_server(spec, workdir) for spec in args.laya]
    if args.llama_server:
        servers += [llama_server(args.llama_server, embedded_model(), config,
                                 args.llama_server_common)
                    for config in args.llama_config or LLAMA_CONFIGS]
    baseline = args.baseline or servers[0].name
    runs = []
    for round_no in range(1, args.rounds + 1):
        for server in servers:
            levels = measure(server, args, workdir / f"{server.name}-{round_no}.log")
            runs.append({"round": round_no, "server": server.name, "levels": levels})
            print(f"round {round_no} {server.name:>16} (load {levels[min(levels)]['load_before']:.2f}): "
                  + "  ".join(f"c={c} {lv['output_tokens_per_s']:7.1f} tok/s TTFT p50 "
                              f"{lv['ttft_ms']['p50']:.0f} ms" for c, lv in levels.items()),
                  flush=True)
    summary = summarize(runs, baseline)
    for server, levels in summary.items():
        for level, s in levels.items():
            ratio = s[f"median_ratio_to_{baseline}"]
            decode = s.get(f"median_decode_ratio_to_{baseline}")
            print(f"{server:>16} c={level}: median {s['median_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{s['median_ttft_p50_ms']:.0f} ms, ratio to {baseline} "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} (rounds {s[f'ratio_to_{baseline}']})"
                  + ("" if decode is None else f"; after the first token {decode:.2f} "
                     f"(rounds {s[f'decode_ratio_to_{baseline}']})"))
    result = {"machine": machine(), "busy": args.busy, "rounds": runs, "summary": summary}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"baseline": baseline, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
