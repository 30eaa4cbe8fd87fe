"""A real ExLlama model served on a GPU: greedy chat completions that repeat, a stream that
says what the whole answer says, a cancelled stream that leaves the generator, usage, and
the GPU memory the server holds against what the plan counted.

They need an NVIDIA GPU with CUDA, the library, and a small model folder named by
LAYA_EXL2_MODEL (an EXL2 or GPTQ folder; tools/gpu_check.sh sets it) or LAYA_EXL3_MODEL
(an EXL3 folder). Elsewhere they are skipped, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from laya_backend_exl2.host import cuda_problem

pytestmark = pytest.mark.slow
CASES = [("exl2", "exllamav2", "LAYA_EXL2_MODEL"), ("exl3", "exllamav3", "LAYA_EXL3_MODEL")]
LOAD_S = 900  # a first import may compile the library's kernels
CHAT = {"model": "exl", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three colours."}]}


def _skip_reason(backend: str, library: str, variable: str) -> str | None:
    if cuda_problem(backend, library) is not None or not os.environ.get(variable):
        return f"needs an NVIDIA GPU with CUDA and {library}, and {variable} naming a model"
    return None


MANIFEST = """
[server]
host = "127.0.0.1"
port = {{port}}

[[models]]
name = "exl"
backend = "{backend}"
path = "{path}"
max_seq_len = 2048
max_num_seqs = 4
kv_cache_dtype = "{dtype}"
"""


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    backend, library, variable = request.param
    if (why := _skip_reason(backend, library, variable)) is not None:
        pytest.skip(why)
    workdir = tmp_path_factory.mktemp(backend)
    dtype = os.environ.get("LAYA_EXL_KV_DTYPE", "q8")
    s = ServerProcess(MANIFEST.format(backend=backend, path=os.environ[variable],
                                      dtype=dtype), workdir)
    try:
        s.wait_ready(timeout=LOAD_S)
        yield s
    finally:
        code = s.stop()
    assert code == 0, s.log()


def chat(server: ServerProcess, **extra: object) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_greedy_chats_repeat_with_usage(server: ServerProcess) -> None:
    first, again = chat(server), chat(server)
    text = first["choices"][0]["message"]["content"]
    assert text and text == again["choices"][0]["message"]["content"]
    usage = first["usage"]
    assert usage["completion_tokens"] <= 24 and usage["prompt_tokens"] > 5
    assert first["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stream_says_what_the_whole_answer_says(server: ServerProcess) -> None:
    whole = chat(server)["choices"][0]["message"]["content"]
    pieces = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
    assert "".join(pieces) == whole


def test_a_stop_string_cuts_the_answer(server: ServerProcess) -> None:
    whole = chat(server)["choices"][0]["message"]["content"]
    stop = whole.strip().split()[1] if len(whole.split()) > 1 else whole[:2]
    cut = chat(server, stop=[stop])["choices"][0]
    assert stop not in cut["message"]["content"] and cut["finish_reason"] == "stop"


def test_a_cancelled_stream_leaves_the_generator(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**CHAT, "stream": True, "max_tokens": 1500,
                            "messages": [{"role": "user",
                                          "content": "Count from 1 to 1000, one a line."}]}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 4:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{server.url}/ready").json()["replicas"]
        if all(rep["running"] == 0 for rep in replicas):
            break
        time.sleep(0.1)
    assert all(rep["running"] == 0 for rep in replicas), replicas
    assert 'finished_reason="abort"' in httpx.get(f"{server.url}/metrics").text
    assert chat(server)["choices"][0]["message"]["content"]  # and it serves on


def test_structured_output_is_refused_with_a_400(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "response_format" in r.text, r.text


def test_the_gpu_memory_held_is_within_the_plan(server: ServerProcess) -> None:
    """What nvidia-smi says the server's process holds, against the plan's GPU lines."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    used = {int(p): int(m) * 2**20 for p, m in
            (line.split(",") for line in out.stdout.strip().splitlines() if line)}
    held = used.get(server.proc.pid)
    # The same manifest planned again (exit 1 where the server's own memory leaves too
    # little free for a second one: the count is what matters here).
    plan = subprocess.run([str(Path(sys.executable).with_name("laya")), "plan",
                           str(server.log_path.with_name("laya.toml")), "--json"],
                          capture_output=True, text=True)
    assert plan.returncode in (0, 1), plan.stderr
    gpu = json.loads(plan.stdout)["gpus"]["cuda:0"]["total_bytes"]
    print(f"GPU memory held by the server: {held} B; planned: {gpu} B")
    assert held is not None, out.stdout
    assert held <= gpu, f"the plan under-counts the GPU: {held} B held, {gpu} B planned"
