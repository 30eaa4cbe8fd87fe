"""Where a streamed token's time goes, layer by layer, on Laya servers this starts.

    python tools/profile_token.py --backend llamacpp --backend torch --concurrency 1,8 \\
        --requests 16 --max-tokens 128 --out docs/benchmarks/profile_token.json

For each backend it starts a fresh server of the embedded model (as ``benchmark_rounds.py``
does: its manifest, ``--options`` as ``[models.options]``, the default worker process), and
at each concurrency level keeps that many streamed chat completions in flight
(``benchmark_serving.py``'s load) while it reads ``laya:engine_layer_seconds_total`` from
``/metrics`` every ``--sample-s``. The layers are laya_core/engine/layer_clock.py's:
the engine thread's ``loop``, ``schedule``, ``prefill`` and ``backend`` (the model's compute
with its sampling, in steps with and without a prompt chunk), ``detokenize`` and
``deliver``; the worker's ``ipc_send`` (its sender thread); the front end's ``ipc_receive``
and ``http``. Per generated token it prints each layer's mean milliseconds
(the level's sums over its tokens) and p50/p90 (over the sampling windows), the client's
inter-token latency (ITL) divided by the tokens a step makes (1 at c=1), and the residue:
that ITL share minus the measured layers but ``prefill`` (steps that feed a prompt, before a
first token: at c=1 outside every gap). The engine thread's layers run one after another;
the others run beside the next step, so the residue is what no layer measured (waits for the
GIL or a thread's wake-up) less whatever ran beside the model. Then the CPU each of the
server's threads spent per token (``/proc``, by the names Laya gives its threads,
``laya_core.logs.start_named``): on a machine whose cores the model's threads fill, what
runs beside them is taken from them, so this, not the wall-time layers, is what Laya's
threads cost the model. Its last line is JSON. One short request warms each server up first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
import benchmark_rounds as rounds  # noqa: E402 - beside this file
import benchmark_serving as serving  # noqa: E402

# The layers in a token's order, and the thread each runs on (one thread's layers never
# overlap one another; different threads' do).
LAYERS = {"loop": "engine", "schedule": "engine", "draft": "engine", "prefill": "engine",
          "backend": "engine",
          "detokenize": "engine", "deliver": "engine", "ipc_send": "worker",
          "ipc_receive": "front", "http": "front"}


def counters(text: str, model: str) -> dict[str, float]:
    """The model's layer seconds, engine steps and generated tokens in a /metrics page,
    summed over its replicas: ``{layer: s, ..., "steps": n, "tokens": n}``."""
    out: dict[str, float] = {"steps": 0.0, "tokens": 0.0}
    names = {"laya:engine_steps": "steps", "laya:engine_generated_tokens": "tokens"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != model:
                continue
            if family.name == "laya:engine_layer_seconds":
                layer = sample.labels["layer"]
                out[layer] = out.get(layer, 0.0) + sample.value
            elif family.name in names:
                out[names[family.name]] += sample.value
    return out


def thread_cpu_s(tree: psutil.Process) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds so far of every thread of a server's process tree, by (pid, tid), with
    the thread's name: "front/" or "worker/" and the name the OS shows (Laya names its
    threads, laya_core.logs.start_named; the front end's main thread, its event loop and
    HTTP server, shows as "main", and unnamed threads, such as asyncio's executor, as
    "other"). A thread takes the name of the thread that started it, so llama.cpp's and
    torch's compute threads count as ``laya-engine``: that line is the model's compute
    and the engine loop's own work together."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for p in [tree, *tree.children(recursive=True)]:
        try:
            cmdline = " ".join(p.cmdline())
            role = ("front" if p.pid == tree.pid else
                    "worker" if "laya_core.replica.worker" in cmdline else p.name())
            for t in p.threads():
                try:
                    comm = Path(f"/proc/{p.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:
                    continue
                name = (comm if comm.startswith("laya-") else
                        "main" if t.id == p.pid else "other")
                out[(p.pid, t.id)] = (f"{role}/{name}", t.user_time + t.system_time)
        except psutil.Error:  # a child that ended meanwhile
            continue
    return out


def thread_cpu_spent(before: dict[tuple[int, int], tuple[str, float]],
                     after: dict[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each thread name spent between two :func:`thread_cpu_s` readings."""
    out: dict[str, float] = {}
    for key, (name, seconds) in after.items():
        out[name] = out.get(name, 0.0) + seconds - before.get(key, (name, 0.0))[1]
    return out



def _per_token_ms(a: dict[str, float], b: dict[str, float]) -> dict[str, float] | None:
    tokens = b["tokens"] - a["tokens"]
    if tokens <= 0:
        return None
    return {layer: (b.get(layer, 0.0) - a.get(layer, 0.0)) * 1000 / tokens for layer in LAYERS}


def breakdown(samples: list[dict[str, float]], itl_s: list[float], wall_s: float,
              ) -> dict[str, Any]:
    """Per generated token, from the level's /metrics samples (first before it, last after
    it) and the client's inter-token gaps: each layer's ms (mean, p50 and p90 over the
    sampling windows), the ITL share, and the residue."""
    first, last = samples[0], samples[-1]
    tokens, steps = last["tokens"] - first["tokens"], last["steps"] - first["steps"]
    mean = _per_token_ms(first, last) or dict.fromkeys(LAYERS, 0.0)
    windows = [w for a, b in zip(samples, samples[1:], strict=False)
               if (w := _per_token_ms(a, b)) is not None]
    per_step = tokens / steps if steps else 1.0  # tokens one step makes: the batch
    itl = serving.percentiles(itl_s, (50, 90))
    layers = {}
    for layer, thread in LAYERS.items():
        spread = serving.percentiles([w[layer] / 1000 for w in windows], (50, 90))  # s in
        layers[layer] = {"thread": thread, "mean_ms": round(mean[layer], 4),
                         "p50_ms": spread["p50"], "p90_ms": spread["p90"]}
    measured = sum(mean.values())
    itl_ms = statistics.fmean(itl_s) * 1000 / per_step if itl_s else 0.0
    decode = measured - mean["prefill"]  # what the gaps between tokens hold
    return {"tokens": int(tokens), "steps": int(steps), "tokens_per_step": round(per_step, 3),
            "wall_ms_per_token": round(wall_s * 1000 / tokens, 4) if tokens else None,
            "layers": layers, "measured_ms": round(measured, 4),
            "itl_ms": {"mean": round(itl_ms, 4),
                       **{k: v and round(v / per_step, 4) for k, v in itl.items()}},
            "decode_measured_ms": round(decode, 4), "residue_ms": round(itl_ms - decode, 4),
            "windows": len(windows)}


def report(name: str, concurrency: int, b: dict[str, Any]) -> list[str]:
    """The breakdown as text lines: one per layer, then the sums."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:8.3f}"

    lines = [f"{name} c={concurrency}: {b['tokens']} tokens in {b['steps']} steps "
             f"({b['tokens_per_step']:.2f} a step), wall {ms(b['wall_ms_per_token']).strip()} "
             "ms/token",
             f"  {'layer':<12} {'thread':<7} {'mean':>8} {'p50':>8} {'p90':>8}  ms/token"]
    for layer, v in b["layers"].items():
        lines.append(f"  {layer:<12} {v['thread']:<7} {ms(v['mean_ms'])} {ms(v['p50_ms'])} "
                     f"{ms(v['p90_ms'])}")
    itl = b["itl_ms"]
    lines += [f"  {'measured':<20} {ms(b['measured_ms'])}",
              f"  {'but prefill':<20} {ms(b['decode_measured_ms'])}",
              f"  {'ITL / tokens a step':<20} {ms(itl['mean'])} {ms(itl['p50'])} "
              f"{ms(itl['p90'])}",
              f"  {'residue':<20} {ms(b['residue_ms'])}"]
    if b.get("threads_cpu_ms"):
        lines.append(f"  CPU by thread (ms/token; laya-engine holds the model's compute "
                     f"threads), total {sum(b['threads_cpu_ms'].values()):.3f}:")
        lines += [f"    {name:<24} {v:8.3f}" for name, v in b["threads_cpu_ms"].items()]
    return lines


async def _scrape(client: httpx.AsyncClient, url: str, model: str) -> dict[str, float]:
    return counters((await client.get(url + "/metrics")).raise_for_status().text, model)


async def profile_level(url: str, args: argparse.Namespace, concurrency: int,
                        server: psutil.Process | None = None) -> tuple[dict[str, Any], int]:
    """One level's load with /metrics read beside it; the breakdown and the failed requests.
    With ``server`` (the server's process), also the CPU each of its threads spent."""
    load = serving.parse_args(["--url", url, "--requests", str(args.requests),
                               "--max-tokens", str(args.max_tokens)])
    load.model = await serving.first_model(load)
    async with httpx.AsyncClient(timeout=30) as client:
        samples = [await _scrape(client, url, load.model)]
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                await asyncio.sleep(args.sample_s)
                samples.append(await _scrape(client, url, load.model))

        sampler = asyncio.ensure_future(sample())
        threads0 = thread_cpu_s(server) if server is not None else {}
        results, wall_s = await serving.run_level(load, load.model, concurrency)
        threads = thread_cpu_s(server) if server is not None else {}
        done.set()
        await sampler
        # The worker's last step message left before its own send was counted: its next
        # state message (every 0.25 s while idle) carries it.
        await asyncio.sleep(0.5)
        samples.append(await _scrape(client, url, load.model))
    ok = [r for r in results if r.ok]
    b = breakdown(samples, [x for r in ok for x in r.itl_s], wall_s)
    if b["tokens"]:
        spent = thread_cpu_spent(threads0, threads)
        b["threads_cpu_ms"] = {name: round(s * 1000 / b["tokens"], 4) for name, s in
                               sorted(spent.items(), key=lambda kv: -kv[1]) if s > 0}
    return b, len(results) - len(ok)


async def warm_up(url: str) -> None:
    """One short request first: a fresh server's first steps are slower (allocations,
    caches), which is no layer's steady cost."""
    load = serving.parse_args(["--url", url, "--requests", "1", "--max-tokens", "8"])
    await serving.run_level(load, await serving.first_model(load), 1)


def _options(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", action="append", choices=("llamacpp", "torch"),
                   help="a backend to profile; repeat for several (default: llamacpp)")
    p.add_argument("--options", type=_options, default={},
                   help='[models.options] as JSON, e.g. \'{"n_threads": 2}\' (an "engine" key '
                   "is [cluster] engine)")
    p.add_argument("--concurrency", type=serving._levels, default=[1, 8])
    p.add_argument("--requests", type=serving._positive, default=16, help="per level")
    p.add_argument("--max-tokens", type=serving._positive, default=128)
    p.add_argument("--sample-s", type=float, default=1.0,
                   help="seconds between /metrics reads during a level (the p50/p90 windows)")
    p.add_argument("--out", type=Path, help="write every level's breakdown as JSON here")
    args = p.parse_args(argv)
    args.backend = args.backend or ["llamacpp"]
    if args.sample_s <= 0:
        p.error("--sample-s must be above 0")
    return args


def profile(backend: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start a server of ``backend``, profile each level, stop it."""
    server = rounds.laya_server(f"{backend}:{json.dumps({**args.options, 'backend': backend})}",
                                workdir)
    proc = server.start(workdir / f"{backend}.log")
    levels: dict[str, Any] = {}
    try:
        asyncio.run(warm_up(server.url))
        for concurrency in args.concurrency:
            b, failed = asyncio.run(profile_level(server.url, args, concurrency,
                                                  psutil.Process(proc.pid)))
            levels[str(concurrency)] = {**b, "failed": failed}
            print("\n".join(report(backend, concurrency, b)), flush=True)
            if failed:
                print(f"  note: {failed} requests failed; see {workdir / f'{backend}.log'}")
    finally:
        rounds.stop(proc)
    return levels


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="laya-profile-"))
    started = time.time()
    result = {"options": args.options, "requests": args.requests, "max_tokens": args.max_tokens,
              "backends": {b: profile(b, args, workdir) for b in args.backend},
              "seconds": round(time.time() - started, 1)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
