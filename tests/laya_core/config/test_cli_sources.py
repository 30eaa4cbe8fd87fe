"""``laya check|plan|serve SOURCE`` with a model file instead of a manifest, flags and LAYA_*
variables over the manifest, and every problem of a run reported at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ServerProcess

from laya_core.plugins import load_registry

pytestmark = pytest.mark.slow  # each test runs the laya command


GOOD = '[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\n'


@pytest.fixture(scope="module")
def gguf() -> str:
    path = load_registry().resolve_model_path("embedded:smollm2-135m-instruct")
    assert path and path.endswith(".gguf")
    return path


def laya(*args: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LAYA_")}
    return subprocess.run([sys.executable, "-m", "laya_core.cli.main", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})}, cwd=cwd)


def settings(out: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The 'ok:' line of ``laya check`` as key -> value."""
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("ok: ")]
    fields = line.split(": ", 2)[2].split(", ")
    return dict(f.split(" ", 1) for f in fields[2:]) | {"name": line.split(": ")[1]}


def test_version_is_the_installed_one() -> None:
    out = laya("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"laya {metadata.version('laya-core')}"


def test_check_a_gguf_file_names_it_by_its_stem_and_prints_decided_sizes(gguf: str) -> None:
    out = laya("check", gguf)
    assert out.returncode == 0, out.stderr
    got = settings(out)
    assert got["name"] == "SmolLM2-135M-Instruct.Q4_1"
    # Decided by the plan, never "None": 8 sequences (their KV pool, 720 MiB, is within the
    # default's 2 GiB) of min(4096, the model's 8192).
    assert got["max_num_seqs"] == "8" and got["max_seq_len"] == "4096"
    assert got["kv_cache_tokens"] == str(8 * 4096)


def test_every_problem_of_a_manifest_in_one_run(tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text('[server]\nprot = 1\n[[models]]\nname = "m"\n'
                        'path = "embedded:smollm2-135m-instruct"\nmax_seq_len = 8\n'
                        'max_num_seqs = 0\noptions.n_thread = 2\n'
                        '[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\n')
    out = laya("check", str(manifest))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    for key in ("server.prot", "models[0].max_seq_len", "models[0].max_num_seqs",
                "models[0].options.n_thread", "models[1].name"):
        assert f"laya: manifest error: {key}: " in out.stderr, out.stderr
    assert "5 problems" in out.stderr


def test_flags_beat_variables_which_beat_the_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(GOOD + "max_seq_len = 2048\nmax_num_seqs = 2\n")
    assert settings(laya("check", str(manifest)))["max_seq_len"] == "2048"
    env = {"LAYA_MAX_MODEL_LEN": "1024", "LAYA_MAX_NUM_SEQS": "3"}
    got = settings(laya("check", str(manifest), env=env))
    assert (got["max_seq_len"], got["max_num_seqs"]) == ("1024", "3")
    got = settings(laya("check", str(manifest), "--ctx-size", "512", "--parallel", "5", env=env))
    assert (got["max_seq_len"], got["max_num_seqs"]) == ("512", "5")
    got = settings(laya("check", str(manifest), "--served-model-name", "other"))
    assert got["name"] == "other"


def test_a_bad_value_names_the_flag_or_variable_and_the_key(gguf: str) -> None:
    out = laya("check", gguf, "--max-model-len", "8", "-np", "0", "--threads", "0",
               env={"LAYA_PORT": "http", "LAYA_MEMORY_BUDGET": "lots"})
    assert out.returncode == 2
    for words in ("--max-model-len (models[0].max_seq_len): must be between 16",
                  "--max-num-seqs (models[0].max_num_seqs): must be between 1",
                  "--threads (models[0].options.n_threads):",
                  "LAYA_PORT: expected a whole number, got 'http'",
                  "LAYA_MEMORY_BUDGET (memory.budget):"):
        assert words in out.stderr, out.stderr
    assert "5 problems" in out.stderr


def test_one_model_flags_with_several_models_say_to_use_the_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(GOOD + GOOD.replace('"m"', '"n"'))
    out = laya("check", str(manifest), "--max-num-seqs", "2")
    assert out.returncode == 2
    assert "--max-num-seqs" in out.stderr and "2 [[models]] entries" in out.stderr


@pytest.mark.parametrize(("content", "words"), [
    (b"\x00\x01\xfe\xff binary" * 10, "neither a manifest"),
    ((24).to_bytes(8, "little") + b'{"__metadata__":{}}    ', "safetensors"),
    (b"PK\x03\x04rest-of-a-zip", "zip archive"),
    (b'{"models": []}', "is JSON"),
    (b"\xc3\x28 not utf-8 = 1", "neither a manifest"),
])
def test_a_file_that_is_no_manifest_says_what_it_is(tmp_path: Path, content: bytes,
                                                    words: str) -> None:
    path = tmp_path / "thing.toml"
    path.write_bytes(content)
    for command in ("check", "plan", "serve"):
        out = laya(command, str(path))
        assert out.returncode == 2, out.stderr
        assert words in out.stderr and "Traceback" not in out.stderr + out.stdout


def test_a_missing_model_file_is_named(tmp_path: Path) -> None:
    out = laya("check", "nowhere.gguf", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "SOURCE (models[0].path)" in out.stderr and "nowhere.gguf" in out.stderr


def test_plan_of_a_gguf_file_as_json(gguf: str) -> None:
    out = laya("plan", gguf, "--json", "-np", "2", "-c", "1024")
    assert out.returncode == 0, out.stderr
    (replica,) = json.loads(out.stdout)["replicas"]
    assert replica["max_seq_len"] == 1024 and replica["max_num_seqs"] == 2


def test_serve_a_gguf_file_with_flags_and_the_openai_client(gguf: str, tmp_path: Path) -> None:
    key = "test-key-0123456789"
    server = ServerProcess(None, tmp_path, env={"LAYA_API_KEY": "ignored-key-000"}, args=[
        gguf, "--served-model-name", "smol", "--api-key", key, "--max-model-len", "512",
        "--max-num-seqs", "2", "--threads", "1", "--host", "127.0.0.1", "--no-access-log",
        "--allowed-origins", '["https://app.example.com"]'])
    try:
        server.wait_ready(api_key=key)
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        (card,) = client.models.list().data
        assert card.id == "smol" and card.model_extra["max_model_len"] == 512
        reply = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            temperature=0)
        assert reply.usage.completion_tokens == 3
        ready = httpx.get(f"{server.url}/ready", headers={"Authorization": f"Bearer {key}"})
        (replica,) = ready.json()["replicas"]
        assert replica["runtime"]["n_threads"] == 1, replica
        preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    finally:
        assert server.stop() == 0, server.log()
    assert "laya.access" not in server.log()


def test_a_systemd_unit_serves_what_the_plan_was_given(gguf: str) -> None:
    key = "secret-key-0123456789"
    out = laya("plan", gguf, "--systemd", "--user", "svc", "-np", "2", "--no-access-log",
               "--api-key", key, env={"LAYA_MAX_MODEL_LEN": "1024"})
    assert out.returncode == 0, out.stderr
    (exec_start,) = [x for x in out.stdout.splitlines() if x.startswith("ExecStart=")]
    assert exec_start.endswith(f"serve --model {gguf} --max-model-len 1024 --max-num-seqs 2 "
                               "--no-access-log")
    assert "User=svc" in out.stdout.splitlines()
    assert key not in out.stdout and "LAYA_API_KEY" in out.stderr
    refused = laya("plan", "--systemd", "--user", "root")
    assert refused.returncode == 2 and "--user" in refused.stderr
