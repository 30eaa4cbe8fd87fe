"""The run's record: each stage's result gathered into $OUT/gpu_check.json, a one-screen
summary ($OUT/summary.txt, printed at the end), and the logs copied to $OUT within what may
come back from the GPU machine (8 files, 16 MiB each).

    python tools/gpu_check/report.py record NAME STATUS REASON   # for a stage that could not
    python tools/gpu_check/report.py collect [--print]            # after every stage
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

STAGES = ("environment", "router_build", "models", "logits", "throughput", "gpu_tests",
          "exl2_build", "exl2")
LOG_GROUPS = {"stages.log": ("environment", "models", "logits", "throughput", "gpu_tests",
                             "exl2"),
              "builds.log": ("router_build", "exl2_build")}
LOG_PART_BYTES = 2 * 2**20  # the end of each log kept in $OUT (an nvcc failure can be long)


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or common.REPO / "tools" / "gpu_check" / "out")


def results() -> dict[str, dict[str, Any]]:
    found = {}
    for name in STAGES:
        path = common.result_path(name)
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def tail(path: Path, limit: int = LOG_PART_BYTES) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        text = f.read().decode("utf-8", "replace")
    cut = "[... earlier lines left out ...]\n" if path.stat().st_size > limit else ""
    return cut + text


def copy_logs(out: Path) -> None:
    logs = common.work_dir() / "logs"
    groups = {name: [logs / f"{stage}.log" for stage in stages]
              for name, stages in LOG_GROUPS.items()}
    groups["servers.log"] = sorted(logs.glob("server-*.log"))
    for name, paths in groups.items():
        parts = [f"===== {p.name} =====\n{tail(p)}" for p in paths if p.is_file()]
        if parts:
            (out / name).write_text("\n".join(parts))


# One line of numbers per stage, for the summary.

def _environment(n: dict[str, Any]) -> str:
    env = n.get("env", {})
    wheels = n.get("wheels")
    carried = f"{len(wheels['installed'])} wheels installed" if isinstance(wheels, dict) \
        else "no wheels"
    text = (f"{env.get('gpu') or 'no GPU'}, torch {env.get('torch')} (CUDA "
            f"{env.get('torch_cuda')}), transformers {env.get('transformers')}, python "
            f"{env.get('python')}; {carried}")
    missing = [t for t, where in (env.get("tools") or {}).items() if not where]
    missing += [] if env.get("python_h", True) else ["Python.h"]
    if missing:
        text += f"; missing for the compiles: {', '.join(missing)}"
    cuda = n.get("cuda_overheads") or {}
    if "gpu_context_bytes" in cuda:  # laya_core/memory/devices.py's estimates: 512 and 1536
        text += (f"; CUDA context {_mib(cuda['gpu_context_bytes'])} on the GPU (plan: 512 MiB),"
                 f" torch + CUDA {_mib(cuda['host_rss_torch_cuda_bytes'])} of RSS (plan: 1536)")
    return text


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB"


def _memory(m: dict[str, Any] | None) -> str:
    """The served replica's planned GPU bytes against its worker's measured ones."""
    if not m:
        return ""
    plan, measured = m.get("planned", {}), m.get("measured", {})
    gpu = sum((plan.get("gpu_bytes") or {}).values())
    return (f"GPU planned {_mib(gpu)}, worker holds {_mib(measured.get('gpu_bytes'))}; host "
            f"planned {_mib(plan.get('total_bytes'))}, worker RSS peak "
            f"{_mib(measured.get('rss_peak_bytes'))}")


def _models(n: dict[str, Any]) -> str:
    return "; ".join(f"{k}: {v['parameters'] / 1e9:.2f} B params, "
                     f"{v['safetensors_bytes'] / 2**30:.2f} GiB" for k, v in n.items()
                     if isinstance(v, dict))


def _logits(n: dict[str, Any]) -> str:
    if "fp32" not in n:
        return ""
    f32, b16, hf16 = n["fp32"], n["bf16_vs_fp32"], n["hf_bf16_vs_fp32"]
    greedy = "/".join(map(str, n["fp32_greedy_same"]))
    int8 = n.get("int8") or {}
    int8_text = f"top-1 {int8['top1_vs_fp32']:.0%}" if int8.get("ok") else \
        f"fails ({int8.get('error', '?')[:80]})"
    return (f"fp32 max|d| {f32['max_abs_diff']:.1e}, top-1 {f32['top1_agreement']:.0%}, "
            f"greedy {greedy}; bf16 max|d| vs fp32 {b16['max_abs_diff']:.3f} "
            f"(transformers bf16 {hf16['max_abs_diff']:.3f}), top-1 {b16['top1_agreement']:.0%}"
            f" ({hf16['top1_agreement']:.0%}); int8 {int8_text}")


def _throughput(n: dict[str, Any]) -> str:
    laya, hf = n.get("laya", {}), n.get("transformers", {})
    parts = []
    for key, rate, what in (("c1", "decode_tokens_per_s", "decode"),
                            ("c64", "output_tokens_per_s", "output"),
                            ("c16", "output_tokens_per_s", "output")):
        if key in laya:
            theirs = hf.get(key, {}).get(rate)
            ratio = f" ({laya[key][rate] / theirs:.2f}x)" if theirs else ""
            parts.append(f"c={key[1:]} {what}: Laya {laya[key][rate]} vs transformers "
                         f"{theirs} tok/s{ratio}")
    if "battery" in laya:
        b = laya["battery"]
        parts.append(f"battery {len(b['passed'])}/{len(b['passed']) + len(b['failed'])}")
    parts.append(_memory(laya.get("memory")))
    return "; ".join(p for p in parts if p)


def _exl2_build(n: dict[str, Any]) -> str:
    if "build_s" not in n:
        return ""
    return (f"built in {n['build_s']} s (nvcc {n.get('nvcc_major')}, arch "
            f"{n.get('arch_list')}); paged flash-attn "
            f"{'yes' if n.get('flash_attn_paged') else 'no (batch 1 only)'}")


def _exl2(n: dict[str, Any]) -> str:
    parts = []
    if c := n.get("conversion"):
        parts.append(f"converted in {c['convert_s']} s, {c['bytes'] / 2**30:.2f} GiB")
    if (s := n.get("serving")) and "battery" in s:
        b = s["battery"]
        parts.append(f"battery {len(b['passed'])}/{len(b['passed']) + len(b['failed'])}")
        parts.append(_memory(s.get("memory")))
    if t := n.get("tests"):
        parts.append(f"tests/backend_exl2: {t.get('summary') or t.get('why')}")
    return "; ".join(parts)


def _router(n: dict[str, Any]) -> str:
    return f"built in {n['build_s']} s" if "build_s" in n else ""


DETAILS: dict[str, Callable[[dict[str, Any]], str]] = {
    "environment": _environment, "router_build": _router, "models": _models,
    "logits": _logits, "throughput": _throughput, "exl2_build": _exl2_build, "exl2": _exl2}


def summary(found: dict[str, dict[str, Any]], elapsed: float) -> str:
    mode = "CPU dry run" if common.dry_run() else "GPU run"
    lines = [f"gpu_check: {mode}, {elapsed:.0f} s"]
    for name in STAGES:
        r = found.get(name)
        if r is None:
            lines.append(f"  {'-':7} {name:13} not run")
            continue
        numbers = r.get("numbers", {})
        try:
            detail = DETAILS.get(name, lambda _: "")(numbers)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            detail = f"(numbers unreadable: {e})"
        seconds = numbers.get("seconds")
        took = f" [{seconds:.0f} s]" if isinstance(seconds, int | float) else ""
        text = "; ".join(x for x in (r.get("reason"), detail) if x)
        lines.append(f"  {r['status']:7} {name:13}{took} {text}")
    lines.append(f"  details: {out_dir() / 'gpu_check.json'}; logs: stages.log, builds.log, "
                 "servers.log")
    return "\n".join(lines)


def collect(show: bool) -> None:
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    found = results()
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    elapsed = time.time() - started
    record = {"mode": "cpu-dry-run" if common.dry_run() else "gpu",
              "seconds": round(elapsed, 1),
              "stages": [found.get(n, {"name": n, "status": "NOT RUN"}) for n in STAGES]}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    text = summary(found, elapsed)
    (out / "summary.txt").write_text(text + "\n")
    copy_logs(out)
    if show:
        print(text)


def main(argv: list[str]) -> None:
    if argv[0] == "record":
        name, status, reason = argv[1], argv[2], argv[3]
        if not common.result_path(name).is_file():  # a stage's own result stands
            common.write_result(name, status, reason)
    elif argv[0] == "status":  # a stage's status, or "none"
        r = results().get(argv[1])
        print(r["status"] if r else "none")
    else:
        collect(show="--print" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
