"""Weight repacking: off where llama.cpp's AMX buffer would crash, honoured when set, visible.

llama.cpp moves some weight types into "extra" buffers at load (CPU_REPACK everywhere; AMX
in a build compiled on a CPU with AMX, whose matrix multiply segfaults). The backend's
``repack`` option chooses; ``describe()`` (the start-up log and /ready) says what happened.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap
from typing import Any

import llama_cpp
import pytest
from laya_backend_llamacpp import cpu
from laya_backend_llamacpp.backend import LlamaCppBackend

from laya_core.backend import ModelConfig
from laya_core.builtin.model_paths import embedded_file

PLAIN_BUFFERS = {"CPU", "CPU_Mapped"}  # weights left in llama.cpp's own layout
HOST = cpu.read_cpuinfo()
FEATURES = cpu.build_features(llama_cpp.llama_print_system_info().decode())
HAS_AMX = "amx_int8" in HOST.flags and "AMX_INT8" in FEATURES


def loaded(path: str, **options: Any) -> dict[str, Any]:
    backend = LlamaCppBackend(ModelConfig(name="m", backend="llamacpp", path=path,
                                          max_seq_len=256, max_num_seqs=1, options=options))
    try:
        backend.load_weights()
        return backend.describe()
    finally:
        backend.close()


def test_the_runtime_report_names_the_cpu_and_where_the_weights_went() -> None:
    report = loaded(embedded_file("smollm2-135m-instruct"))
    assert report["cpu"] == HOST.model and report["cpu_flags"] == HOST.notable_flags
    assert "OPENMP" in report["llama_cpp_features"] or "AVX2" in report["llama_cpp_features"]
    assert report["llama_cpp_version"] == importlib.metadata.version("llama-cpp-python")
    assert report["llama_cpp_version"].endswith("+laya.q41gemm.rowexact")  # make install's
    # Its rows are exact with flash attention off, the default: Q4_1 layers, a Q8_0 head.
    assert report["batch_invariant"] is True, report["batch_invariant_reason"]
    assert report["repack"] is cpu.choose_repack("auto", HOST, FEATURES).enabled
    assert report["repack_reason"].startswith("auto: ")
    # The Q4_1 file: no extra buffer takes Q4_1 but AMX's, and auto keeps that one off.
    assert set(report["weight_buffer_bytes"]) <= PLAIN_BUFFERS
    assert report["use_mmap"] is True
    assert sum(report["weight_buffer_bytes"].values()) == pytest.approx(92.1 * 2**20, rel=0.02)


def test_the_repack_option_is_honoured(q4_0_model: str) -> None:
    on = loaded(q4_0_model, repack=True)
    off = loaded(q4_0_model, repack=False)
    assert on["repack"] is True and off["repack"] is False
    extra = set(on["weight_buffer_bytes"]) - PLAIN_BUFFERS
    assert ("AMX" in extra) if HAS_AMX else extra == {"CPU_REPACK"}, on["weight_buffer_bytes"]
    assert set(off["weight_buffer_bytes"]) <= PLAIN_BUFFERS
    # Repacked weights are copied out of the file: reading it, not mapping it, keeps them
    # resident once (use_mmap "auto"); without repacking the file is mapped.
    assert on["use_mmap"] is False and off["use_mmap"] is True
    assert loaded(q4_0_model, repack=True, use_mmap=True)["use_mmap"] is True


DECODE_WITH_DEFAULTS = textwrap.dedent("""
    import json, sys
    from laya_core.backend import ModelConfig, StepItem
    from laya_core.types import SamplingParams
    from laya_backend_llamacpp.backend import LlamaCppBackend
    backend = LlamaCppBackend(ModelConfig(name="m", backend="llamacpp", path=sys.argv[1],
                                          max_seq_len=256, max_num_seqs=1))
    backend.load_weights()
    backend.allocate_cache(n_ctx=256, max_num_seqs=1)
    backend.start_sequence(0, SamplingParams(temperature=0.0))
    prompt = backend.tokenize("The capital of France is", add_special=False)
    token = backend.step([StepItem(0, prompt, 0, True)])[0].sample.token_id
    for pos in range(len(prompt), len(prompt) + 8):
        token = backend.step([StepItem(0, [token], pos, True)])[0].sample.token_id
    print(json.dumps(backend.describe()))
""")


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX (amx_int8) and a llama.cpp "
                    "built with it: elsewhere there is no AMX weight buffer to crash in")
@pytest.mark.parametrize("model", ["embedded", "q4_0"])
def test_defaults_decode_on_an_amx_cpu(model: str, q4_0_model: str) -> None:
    """In a child process, since the crash this guards against is a segfault."""
    path = embedded_file("smollm2-135m-instruct") if model == "embedded" else q4_0_model
    run = subprocess.run([sys.executable, "-c", DECODE_WITH_DEFAULTS, path],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["repack"] is False and "AMX" not in report["weight_buffer_bytes"]
