"""The backend conformance suite (laya_core.testing), run with its one documented command
against the toy backend, the llama.cpp backend and the torch backend, each in a pytest of
its own, as a backend package runs it against itself; and against the engine-level
example backend (examples/laya-backend-openai) in front of a Laya server, where the
step-level checks are skipped, saying why."""

from __future__ import annotations

import json
import os
import re
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


def conformance(backend: str, model: str, options: dict[str, object], extra: list[str],
                cwd: Path) -> subprocess.CompletedProcess[str]:
    """The suite's documented command, with ``-rs``: each skip's reason in the summary."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "laya_core.testing.plugin",
               "--pyargs", "laya_core.testing.test_conformance", "--laya-backend", backend,
               "--laya-model", model, "--laya-options", json.dumps(options), *extra,
               "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    print(f"\n{backend}: {run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ''}")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run


# The checks a backend may leave out, skipped saying why: the toy backend applies no LoRA
# adapters, so the suite skips its adapter check for it; llama.cpp and torch run every check.
NOT_SUPPORTED = {"toy": ["supports_lora is False"], "llamacpp": [], "torch": []}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backend_passes_the_conformance_suite(backend: str, tmp_path: Path) -> None:
    model, options, extra = BACKENDS[backend]
    out = conformance(backend, model, options, extra, tmp_path).stdout.strip()
    summary = out.splitlines()[-1]
    assert " passed" in summary and "failed" not in summary
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == len(NOT_SUPPORTED[backend]), skips
    assert all(why in line for why, line in zip(NOT_SUPPORTED[backend], skips, strict=True))


def test_an_engine_level_backend_passes_what_applies_to_it(tmp_path: Path) -> None:
    from conftest import SMOLLM_MANIFEST, serving

    upstream = SMOLLM_MANIFEST.replace("max_num_seqs = 8", "max_num_seqs = 2").replace(
        "embeddings = true", "[models.options]\nn_threads = 1")
    with serving(upstream, tmp_path) as server:
        out = conformance("openai", f"{server.url}/v1", {"model": "smollm2"}, [],
                          tmp_path).stdout
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    skipped = re.search(r"(\d+) skipped", summary)
    assert passed and skipped and "failed" not in summary, summary
    assert int(passed.group(1)) >= 5  # the EngineClient's checks
    reasons = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", out, re.M)
    assert sum(int(n) for n, _ in reasons) == int(skipped.group(1))
    assert all(why.startswith("a step-level check: the openai backend is engine-level")
               for _, why in reasons), reasons
