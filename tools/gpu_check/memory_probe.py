"""Memory as measured beside memory as planned: the two numbers laya_core's GPU plan still
estimates (laya_core/memory/devices.py: a CUDA context of 512 MiB on the GPU, libtorch with
CUDA's libraries 1.5 GiB in host RAM), and a served replica's planned ledger against what its
worker process holds on the GPU (NVML) and in RAM.

    python tools/gpu_check/memory_probe.py context   # one JSON line, in a fresh process
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MIB = 2**20


def rss_bytes(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def gpu_used_bytes() -> dict[str, Any]:
    """Device 0's used memory, and the bytes each process holds on it (NVML; None without)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        procs = {int(p.pid): int(p.usedGpuMemory or 0)
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return {"used": used, "processes": procs}
    except Exception as e:  # noqa: BLE001 - no NVML here: say so
        return {"used": None, "processes": {}, "error": f"{type(e).__name__}: {e}"}


def measure_context() -> dict[str, Any]:
    """In this (fresh) process: the GPU bytes that CUDA's context and the libraries a step
    uses (cuBLAS, SDPA) take beyond torch's own allocations, and the host RSS that importing
    torch and starting CUDA adds."""
    before, gpu_before = rss_bytes(), gpu_used_bytes()
    import torch
    import torch.nn.functional as F

    imported = rss_bytes()
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    y = x @ x.T  # cuBLAS loaded and its workspace made
    q = x.view(1, 8, 512, 128)  # [batch, heads, tokens, head_dim]
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize()
    after, gpu_after = rss_bytes(), gpu_used_bytes()
    reserved = torch.cuda.memory_reserved()
    out: dict[str, Any] = {
        "host_rss_import_torch_bytes": imported["VmRSS"] - before["VmRSS"],
        "host_rss_torch_cuda_bytes": after["VmRSS"] - before["VmRSS"],
        "torch_reserved_bytes": reserved, "checksum": float(y.float().sum())}
    if gpu_before["used"] is not None and gpu_after["used"] is not None:
        out["gpu_context_bytes"] = gpu_after["used"] - gpu_before["used"] - reserved
    else:
        out["nvml"] = gpu_before.get("error")
    return out


def cuda_overheads() -> dict[str, Any]:
    """``measure_context`` in a process of its own, so nothing else is counted."""
    done = subprocess.run([sys.executable, __file__, "context"], capture_output=True,
                          text=True, timeout=120, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def planned(manifest: Path) -> dict[str, Any]:
    """``laya plan --json``'s ledger of the manifest's one replica, where the plan has one."""
    done = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", "--json",
                           str(manifest)], capture_output=True, text=True, timeout=120,
                          check=False)
    try:
        replica = json.loads(done.stdout)["replicas"][0]
    except (ValueError, LookupError):
        return {"error": (done.stderr.strip().splitlines() or ["no plan"])[-1]}
    keep = ("weights_bytes", "kv_pool_bytes", "overhead_bytes", "total_bytes", "gpu_bytes")
    out = {k: replica.get(k) for k in keep}
    out["overheads"] = {o["name"]: [o["bytes"], o.get("device", "cpu")]
                        for o in replica.get("overheads", [])}
    return out


def worker_usage(pid: int) -> dict[str, Any]:
    """What a replica's worker process holds: its GPU bytes (NVML) and its RSS and peak."""
    gpu = gpu_used_bytes()
    out: dict[str, Any] = {"gpu_bytes": gpu["processes"].get(pid), "gpu_used_bytes": gpu["used"]}
    try:
        out |= {"rss_bytes": rss_bytes(pid)["VmRSS"], "rss_peak_bytes": rss_bytes(pid)["VmHWM"]}
    except OSError:
        pass
    return out


def replica_memory(manifest: Path, status: dict[str, Any]) -> dict[str, Any]:
    """Planned against measured for the served replica whose /ready body is ``status``."""
    runtime = (status.get("replicas") or [{}])[0].get("runtime") or {}
    pid = runtime.get("pid")
    measured = worker_usage(int(pid)) if pid else {"error": "/ready names no worker pid"}
    return {"planned": planned(manifest), "measured": measured}


if __name__ == "__main__" and sys.argv[1:] == ["context"]:
    print(json.dumps(measure_context()))
