"""GPTQ and AWQ folders made from the embedded model by the tools their users quantize with,
on CPU, and gptqmodel's reading of them (the reference).

- ``gptq``, ``awq``, ``gptq-asym``, ``awq-asym``: auto-round, 4 bits, round-to-nearest
  (``--iters 0``, no calibration data); each run writes a GPTQ (v1 zeros) and an AWQ
  folder of the same integers. ``--asym`` gives real zero points.
- ``gptq-act-order``: gptqmodel, 4 bits, symmetric, act-order (``desc_act``), v1 zeros.
- ``gptq8-act-order-v2``: gptqmodel, 8 bits, asymmetric, act-order, v2 zeros.

All in groups of 32 inputs: SmolLM2's hidden size, 576, is no multiple of 128. They are made
once (the Hugging Face export, two auto-round runs and two gptqmodel runs: about 4 minutes of
one CPU) and kept under ``$LAYA_TEST_CACHE`` (default ``~/.cache/laya-tests``), keyed by the
tools' versions; a lock keeps two test processes from making them at once.

gptqmodel pins numpy and transformers versions the rest of the suite does not take, so
``make install`` puts it, without its dependencies, in a folder of its own
(``.venv/gptqmodel-ref``), and it runs in a child process (``gptqmodel_side.py``) with that
folder on its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GPTQMODEL = Path(sys.prefix) / "gptqmodel-ref"
# The tools run on one thread each: the suite runs on every core already, and torch's
# threads beside a busy neighbour wait on each other far longer than one thread computes.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}
SIDE = Path(__file__).with_name("gptqmodel_side.py")
# Each gptqmodel folder: its quantize_config (gptqmodel's QuantizeConfig arguments).
GPTQMODEL_FOLDERS = {
    "gptq-act-order": {"bits": 4, "group_size": 32, "desc_act": True, "sym": True},
    "gptq8-act-order-v2": {"bits": 8, "group_size": 32, "desc_act": True, "sym": False,
                           "format": "gptq_v2"},
}


def _gptqmodel_version() -> str:
    (info,) = GPTQMODEL.glob("gptqmodel-*.dist-info")
    return info.name.removeprefix("gptqmodel-").removesuffix(".dist-info")


def _side(*args: str, timeout: int = 900) -> None:
    """Runs gptqmodel_side.py with the side install on its path (paths: absolute)."""
    assert GPTQMODEL.is_dir(), f"{GPTQMODEL} is missing: `make install` puts gptqmodel there"
    # (gptqmodel's loader asks its CPU pool for 2 workers, and fails with fewer.)
    env = {**ONE_THREAD, "PYTHONPATH": str(GPTQMODEL), "GPTQMODEL_CPU_WORKERS": "2"}
    with tempfile.TemporaryDirectory() as scratch:  # it writes logs/ where it runs
        run = subprocess.run([sys.executable, str(SIDE.resolve()), *args], env=env, cwd=scratch,
                             capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]


@contextlib.contextmanager
def _made_once(out: Path) -> Iterator[Path | None]:
    """Yields a scratch folder to write ``out`` into (moved to ``out`` after), or None when
    ``out`` is there already."""
    if out.exists():
        yield None
        return
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    tmp.rename(out)


def _auto_round(hf: Path, out: Path, *flags: str) -> None:
    with _made_once(out) as tmp:
        if tmp is None:
            return
        subprocess.run([sys.executable, "-m", "auto_round", "--model", str(hf), "--bits", "4",
                        "--group_size", "32", "--iters", "0", "--disable_opt_rtn", *flags,
                        "--format", "auto_gptq,auto_awq", "--output_dir", str(tmp)],
                       check=True, capture_output=True, timeout=900, env=ONE_THREAD)
        (made,) = tmp.iterdir()  # auto-round names it after the model and the scheme
        for kind in made.iterdir():
            kind.rename(tmp / kind.name)
        made.rmdir()


def quantized_folders() -> dict[str, Path]:
    """Every folder above by name (and ``hf``: the dense bfloat16 export they come from)."""
    import auto_round
    from laya_backend_torch.export import main as export_main

    from laya_core.builtin.model_paths import embedded_file

    cache = Path(os.environ.get("LAYA_TEST_CACHE", Path.home() / ".cache" / "laya-tests"))
    root = cache / f"smollm2-auto-round-{auto_round.__version__}-gptqmodel-{_gptqmodel_version()}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _made_once(root / "hf") as tmp:
            if tmp is not None:
                assert export_main(["--dtype", "bfloat16",
                                    embedded_file("smollm2-135m-instruct"), str(tmp)]) == 0
        for name, flags in (("sym", ()), ("asym", ("--asym",))):
            _auto_round(root / "hf", root / name, *flags)
        for name, config in GPTQMODEL_FOLDERS.items():
            with _made_once(root / name) as tmp:
                if tmp is not None:
                    _side("quantize", str(root / "hf"), str(tmp), json.dumps(config))
    return {"hf": root / "hf",
            "gptq": root / "sym" / "auto-gptq", "awq": root / "sym" / "auto-awq",
            "gptq-asym": root / "asym" / "auto-gptq", "awq-asym": root / "asym" / "auto-awq",
            **{name: root / name for name in GPTQMODEL_FOLDERS}}


def gptqmodel_reference(folders: dict[str, Path], prompts: list[list[int]], greedy: int,
                        greedy_prompts: int, out: Path) -> dict[str, dict[str, Any]]:
    """gptqmodel's reading of each of ``folders`` (gptqmodel_side.py's ``reference``),
    through its torch kernels: GPTQ_TORCH, or AWQ_TORCH for an AWQ folder."""
    import torch

    def backend(folder: Path) -> str:
        method = json.loads((folder / "config.json").read_text())["quantization_config"]
        return "AWQ_TORCH" if method["quant_method"] == "awq" else "GPTQ_TORCH"

    spec = {"folders": {name: [str(f), backend(f)] for name, f in folders.items()},
            "prompts": prompts, "greedy": greedy, "greedy_prompts": greedy_prompts}
    _side("reference", json.dumps(spec), str(out))
    found: dict[str, dict[str, Any]] = torch.load(out)
    return found
