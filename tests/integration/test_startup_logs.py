"""What ``laya serve`` logs from start to exit, read from a real server's output: one line
per replica load with its time and memory, one ready line with the URL and the models, one
shutdown line with its reason, and no line twice."""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM_BACKENDS, ServerProcess, free_port
from hostile_gguf import embedded, with_metadata

from laya_core.units import fmt_bytes

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}
access_log = false

[[models]]
name = "smollm2"
backend = "{backend}"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 256
max_num_seqs = 2
replicas = 2
"""
# A load line ends with the backend's runtime, whose first key is this.
FIRST_RUNTIME_KEY = {"llamacpp": "cpu", "torch": "device"}
# SmolLM2-135M's parameters: its layers' matrices, and its tied embedding (49,152 x 576).
SMOLLM2_LAYER_MATRICES, SMOLLM2_EMBEDDING = 106.2e6, 28.3e6


def torch_weight_bytes(runtime: dict[str, str]) -> float:
    """What the torch backend keeps of them: in its dtype, or int8 (the layers and head),
    or int4 layers (half a byte, and a 2-byte scale and zero per 32) with an int8 head."""
    width = {"bfloat16": 2, "float32": 4}[runtime["dtype"]]
    layer, head = {"none": (width, width), "int8": (1, 1),
                   "int4": (0.5 + 4 / 32, 1)}[runtime["quantize"]]
    return SMOLLM2_LAYER_MATRICES * layer + SMOLLM2_EMBEDDING * head


def load_line(backend: str) -> re.Pattern[str]:
    return re.compile(r"smollm2 replica (\d) ready in (\d+\.\d) s: weights ([\d.]+ MiB), "
                      r"KV pool ([\d.]+ [KM]iB) \((\d+) tokens\), planned ([\d.]+ [MG]iB), "
                      rf"process resident ([\d.]+ [MG]iB); {FIRST_RUNTIME_KEY[backend]} ")


def wait_for_line(server: ServerProcess, needle: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while needle not in server.log():
        assert time.monotonic() < deadline, f"no {needle!r} in:\n{server.log()}"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", SMOLLM_BACKENDS)
def test_the_log_tells_the_load_the_ready_moment_and_the_shutdown(tmp_path: Path,
                                                                  backend: str) -> None:
    server = ServerProcess(MANIFEST.replace("{backend}", backend), tmp_path)
    server.wait_ready()
    replicas = httpx.get(f"{server.url}/ready").json()["replicas"]
    wait_for_line(server, " ready in ")
    wait_for_line(server, f"on {server.url}: ")
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    server.stop()
    lines = server.log().splitlines()
    assert code == 0, server.log()

    twice = [line for line, n in collections.Counter(lines).items() if n > 1]
    assert not twice, f"printed more than once: {twice}"
    assert sum("Running on" in line for line in lines) == 1
    assert "loading 2 replica(s) of smollm2" in lines[0] and server.url in lines[0]

    load_pattern = load_line(backend)
    loads = {int(m[1]): m for line in lines if (m := load_pattern.search(line))}
    assert sorted(loads) == [0, 1], server.log()
    for replica in replicas:
        load = loads[replica["replica"]]
        assert float(load[2]) > 0  # how long it took is the machine's, not asserted
        assert load[4] == fmt_bytes(replica["kv_pool_bytes"])
        assert int(load[5]) == replica["kv_cache_capacity_tokens"]
        weights_mib = float(load[3].removesuffix(" MiB"))
        if backend == "torch":
            assert abs(weights_mib - torch_weight_bytes(replica["runtime"]) / 2**20) < 10
        else:
            assert 80 < weights_mib < 120  # the 92 MiB embedded file

    ready = [i for i, line in enumerate(lines) if f"on {server.url}: smollm2 (2 replicas)" in line]
    assert len(ready) == 1 and re.search(r"laya: ready in \d+\.\d s on ", lines[ready[0]])
    assert ready[0] > max(i for i, line in enumerate(lines) if load_pattern.search(line))
    shutdown = [i for i, line in enumerate(lines) if "shutting down" in line]
    assert len(shutdown) == 1 and shutdown[0] > ready[0]
    assert "shutting down (SIGTERM); in-flight requests have up to 30 s" in lines[shutdown[0]]


@pytest.mark.parametrize("backend", SMOLLM_BACKENDS)
def test_the_shutdown_line_says_no_model_loaded(tmp_path: Path, backend: str) -> None:
    refusing = with_metadata(embedded(), tmp_path / "refusing.gguf", "tokenizer.chat_template",
                             "{{ raise_exception('this model takes no chats') }}", "str")
    manifest = tmp_path / "laya.toml"
    manifest.write_text(MANIFEST.replace("{port}", str(free_port()))
                        .replace("{backend}", backend)
                        .replace("embedded:smollm2-135m-instruct", str(refusing))
                        .replace("replicas = 2", "replicas = 1"))
    run = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "serve", str(manifest)],
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    lines = out.splitlines()
    assert [line for line in lines if "shutting down" in line] == [
        "laya: INFO laya: shutting down (no model loaded: every replica failed); in-flight "
        "requests have up to 30 s"]
    assert not any(" ready in " in line for line in lines), out
    assert "smollm2 replica 0 failed to load: TemplateError" in out
