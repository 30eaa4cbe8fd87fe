"""Stage "exl2": the 1B model quantized to EXL2 by exllamav2, served through Laya's ``exl2``
backend, and the battery and tests/backend_exl2 run against it.

    python tools/gpu_check/exl2.py

1. Waits for the background build of exllamav2's extension (builds.py, stage "exl2_build").
2. Converts with exllamav2's own script, ``python -m exllamav2.conversion.convert_exl2``:
   4.0 bits a weight (6 for the head), calibration from the text files exllamav2 ships
   (``standard_cal_data``: no dataset download) in rows of ``CAL_TOKENS`` tokens. The script
   imports fastparquet at the top for ``-c PARQUET`` datasets, which are not used here: where
   fastparquet is missing, an empty stand-in module is put on its path.
3. Serves the EXL2 folder with ``backend = "exl2"`` (options from GPU_CHECK_EXL2_OPTIONS, a
   JSON object) and runs the OpenAI battery (battery.py).
4. Runs ``pytest tests/backend_exl2`` with LAYA_EXL2_MODEL set to the folder, where those
   tests exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import battery
import common
import memory_probe
from server import LayaServer

CAL_TOKENS = 256
BITS, HEAD_BITS = "4.0", "6"
MAX_SEQ_LEN = 1024
SERVE_RESERVE_S = 90  # kept from the conversion for serving, the battery and the tests


def seconds_left() -> float:
    deadline = float(os.environ.get("GPU_CHECK_STAGE_DEADLINE", time.time() + 600))
    return deadline - time.time()


def wait_for_build() -> dict[str, Any]:
    """The extension build's result, once it has one (or until the conversion's time is up)."""
    path = common.result_path("exl2_build")
    while not path.is_file():
        if seconds_left() < SERVE_RESERVE_S + 60:
            raise common.StageFailed("exllamav2's extension was still compiling when the "
                                     "time for converting ran out (see builds.log)")
        time.sleep(2)
    return dict(json.loads(path.read_text()))


def fastparquet_stand_in() -> Path | None:
    """A folder holding an empty ``fastparquet`` module, where the real one is missing."""
    import importlib.util

    if importlib.util.find_spec("fastparquet") is not None:
        return None
    folder = common.work_dir() / "stand-ins"
    (folder / "fastparquet").mkdir(parents=True, exist_ok=True)
    (folder / "fastparquet" / "__init__.py").write_text(
        '"""Stand-in: tools/gpu_check calibrates on exllamav2\'s own text files, never '
        'reading parquet."""\n')
    return folder


def convert(source: Path, out: Path) -> dict[str, Any]:
    scratch = common.work_dir() / "exl2-scratch"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if stand_in := fastparquet_stand_in():
        env["PYTHONPATH"] = f"{stand_in}{os.pathsep}{env.get('PYTHONPATH', '')}"
    argv = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(source),
            "-o", str(scratch), "-cf", str(out), "-nr", "-b", BITS, "-hb", HEAD_BITS,
            "-l", str(CAL_TOKENS), "-ml", str(CAL_TOKENS)]
    limit = seconds_left() - SERVE_RESERVE_S
    common.log(f"converting, at most {limit:.0f} s: {' '.join(argv)}")
    start = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        raise common.StageFailed(f"the EXL2 conversion took longer than {limit:.0f} s "
                                 "(see stages.log)") from None
    if done.returncode != 0 or not any(out.glob("*.safetensors")):
        raise common.StageFailed(f"the EXL2 conversion failed (exit {done.returncode}; see "
                                 "stages.log)")
    config = json.loads((out / "config.json").read_text())
    return {"convert_s": round(time.monotonic() - start, 1),
            "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "quantization_config": config.get("quantization_config")}


def exl2_backend() -> str | None:
    """Why Laya cannot serve with ``backend = "exl2"`` here, or None when it can."""
    from laya_core.plugins import load_registry

    registry = load_registry()
    if "exl2" in registry.backends:
        return None
    failures = [str(f) for f in registry.failures if "exl2" in str(f)]
    return "; ".join(failures) or "no exl2 backend is registered (plugins/backend_exl2 missing)"


def serve_and_battery(folder: Path) -> dict[str, Any]:
    options = json.loads(os.environ.get("GPU_CHECK_EXL2_OPTIONS", "{}"))
    model = {"name": "gpu-check-exl2", "backend": "exl2", "path": str(folder),
             "max_seq_len": MAX_SEQ_LEN, "max_num_seqs": 8, "options": options}
    with LayaServer("exl2", model, budget="100GiB") as server:
        replica = server.status()["replicas"][0]
        result = battery.run(server.url, "gpu-check-exl2", MAX_SEQ_LEN)
        return {"ready_s": round(server.ready_s, 1), "runtime": replica.get("runtime"),
                "battery": result,
                "memory": memory_probe.replica_memory(server.manifest, server.status())}


def backend_tests(folder: Path) -> dict[str, Any]:
    tests = common.REPO / "tests" / "backend_exl2"
    if not tests.is_dir():
        return {"status": common.SKIPPED, "why": "tests/backend_exl2 is not in this tree"}
    env = dict(os.environ, LAYA_EXL2_MODEL=str(folder))
    # Their servers' manifests leave [memory] budget "auto" (MemAvailable), which starts low
    # on a VM whose RAM grows as it is used; the same budget as this script's manifests.
    env.setdefault("LAYA_MEMORY_BUDGET", "100GiB")
    limit = max(30.0, seconds_left() - 10)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                               "no:cacheprovider", str(tests)], cwd=common.REPO, env=env,
                              timeout=limit, capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        return {"status": common.FAIL, "why": f"pytest ran past {limit:.0f} s"}
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    # pytest's exit 5: no test was collected
    status = {0: common.PASS, 5: common.SKIPPED}.get(done.returncode, common.FAIL)
    return {"status": status, "exit": done.returncode, "summary": last}


def main() -> None:
    with common.stage("exl2") as numbers:
        if common.dry_run():
            numbers.update(status=common.SKIPPED, reason="dry run: exllamav2 needs CUDA")
            return
        build = wait_for_build()
        if build["status"] != common.PASS:
            numbers.update(status=common.SKIPPED,
                           reason=f"exllamav2's extension did not build: {build['reason']}")
            return
        folder = common.work_dir() / "models" / "1b-exl2"
        numbers["conversion"] = convert(common.model_dir("1b"), folder)
        problems = []
        if why := exl2_backend():
            numbers["serving"] = {"status": common.SKIPPED, "why": why}
            problems.append(f"not served: {why}")
        else:
            try:
                numbers["serving"] = serving = serve_and_battery(folder)
                if serving["battery"]["failed"]:
                    problems.append(battery.summary(serving["battery"]))
            except Exception as e:  # noqa: BLE001 - the tests below still run
                numbers["serving"] = {"status": common.FAIL, "why": str(e)[:400]}
                problems.append(f"not served: {str(e)[:200]}")
        numbers["tests"] = tests = backend_tests(folder)
        if tests["status"] == common.FAIL:
            problems.append(f"tests/backend_exl2: {tests.get('summary') or tests['why']}")
        if problems:
            raise common.StageFailed("; ".join(problems))


if __name__ == "__main__":
    main()
