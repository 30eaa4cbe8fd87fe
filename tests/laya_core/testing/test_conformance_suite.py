"""The backend conformance suite (laya_core.testing), run with its one documented command
against the toy backend, the llama.cpp backend and the torch backend, each in a pytest of
its own, as a backend package runs it against itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a pytest of its own per backend, two of them on the model

TESTS = Path(__file__).resolve().parents[2]
# Each with the options under which a sequence's tokens do not depend on its neighbours. The
# toy reads no weights; the embedded file gives the planner a shape to plan it by.
BACKENDS = {
    "toy": ("embedded:smollm2-135m-instruct", {}, ["--laya-plugin", "toy_backend:PLUGIN"]),
    "llamacpp": ("embedded:smollm2-135m-instruct", {"flash_attn": False, "n_threads": 1}, []),
    "torch": ("embedded:smollm2-135m-instruct", {"deterministic": True, "n_threads": 1}, []),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backend_passes_the_conformance_suite(backend: str, tmp_path: Path) -> None:
    model, options, extra = BACKENDS[backend]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "laya_core.testing.plugin",
               "--pyargs", "laya_core.testing.test_conformance", "--laya-backend", backend,
               "--laya-model", model, "--laya-options", json.dumps(options), *extra,
               "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(f"\n{backend}: {summary}")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary
