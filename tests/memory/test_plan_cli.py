"""laya plan and laya serve's refusal, as a user runs them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import hostile_gguf as hg
import pytest

SEVEN_B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
           "torch_dtype": "float16"}


def laya(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "laya_core.cli.main", *args], capture_output=True,
                          text=True, timeout=120)


def seven_b_manifest(tmp_path: Path, budget: str = "64GiB") -> Path:
    (tmp_path / "llama-7b").mkdir()
    (tmp_path / "llama-7b" / "config.json").write_text(json.dumps(SEVEN_B))
    manifest = tmp_path / "laya.toml"
    manifest.write_text(f'[memory]\nbudget = "{budget}"\n[[models]]\nname = "llama-7b"\n'
                        'path = "llama-7b"\nmax_seq_len = 32768\nmax_num_seqs = 8\n')
    return manifest


def smol_manifest(tmp_path: Path, budget: str, extra: str = "") -> Path:
    """The embedded model at max_seq_len 8192 under ``budget``, plus ``extra`` model keys."""
    manifest = tmp_path / "laya.toml"
    manifest.write_text(f'[memory]\nbudget = "{budget}"\n[[models]]\nname = "smol"\n'
                        'path = "embedded:smollm2-135m-instruct"\nmax_seq_len = 8192\n' + extra)
    return manifest


def test_plan_json_for_a_7b_model_from_config_alone(tmp_path: Path) -> None:
    manifest = seven_b_manifest(tmp_path)
    started = time.perf_counter()
    out = laya("plan", "--json", str(manifest))
    elapsed = time.perf_counter() - started
    assert out.returncode == 1, out.stderr  # does not fit
    plan = json.loads(out.stdout)
    assert plan["fits"] is False and plan["budget_bytes"] == 64 * 2**30
    assert plan["budget_source"] == "manifest [memory] budget"
    (r,) = plan["replicas"]
    assert r["model"] == "llama-7b" and r["kv_bytes_per_token"] == 512 * 1024
    assert r["kv_bytes_per_seq"] == 16 * 2**30 and r["kv_pool_bytes"] == 128 * 2**30
    assert r["max_concurrent_seqs"] == 8
    assert plan["total_bytes"] == plan["runtime_bytes"] + r["total_bytes"]
    assert r["total_bytes"] == r["weights_bytes"] + r["kv_pool_bytes"] + r["overhead_bytes"]
    print(f"laya plan --json of a 7B manifest took {elapsed:.2f} s, Python start included")


def test_plan_text_uses_binary_units_and_fits_the_embedded_model() -> None:
    out = laya("plan")
    assert out.returncode == 0, out.stderr
    assert "KV per token          22.50 KiB" in out.stdout
    assert "weights               92.10 MiB" in out.stdout
    assert "fits:" in out.stdout


@pytest.mark.parametrize("backend", ["llamacpp", "torch"])
def test_plan_reads_a_draft_models_file(tmp_path: Path, backend: str) -> None:
    """`laya plan` resolves a draft model's path (here `embedded:`) as `laya serve` does,
    and prices its weights."""
    manifest = tmp_path / "laya.toml"
    manifest.write_text(f'[[models]]\nname = "m"\nbackend = "{backend}"\n'
                        'path = "embedded:smollm2-135m-instruct"\nmax_seq_len = 512\n'
                        'speculative = { method = "draft", '
                        'model = "embedded:smollm2-135m-instruct" }\n')
    out = laya("plan", str(manifest))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "draft model weights" in out.stdout and "draft model KV" in out.stdout


def test_serve_refuses_with_numbers_and_settings_that_fit(tmp_path: Path) -> None:
    # 1.2 GiB for the model, 64 MiB for the chat-template sandbox the runtime counts,
    # 30 MiB for the logits of scored prompt rows, 236 MiB of saved KV (a quarter of the
    # 43,008-token pool the suggestions below keep), 237 MiB for structured output's
    # grammars (the index, the cache, one compile and the compile child), 29 MiB for prompt
    # lookup's n-gram index (the default's), a compute buffer with flash attention off, and
    # under laya serve the worker process and the front end's tokenizer.
    out = laya("serve", str(smol_manifest(tmp_path, "1940MiB", "max_num_seqs = 8\n")))
    assert out.returncode == 1
    assert "refusing to start" in out.stderr and "DOES NOT FIT" in out.stderr
    assert "1.41 GiB" in out.stderr  # the KV pool: 8 x 8192 x 22.5 KiB
    assert "models[0].max_seq_len = 5120" in out.stderr
    assert "models[0].max_num_seqs = 4" in out.stderr
    assert 'models[0].kv_cache_dtype = "q8_0"' in out.stderr


def test_when_no_single_setting_fits_a_combination_is_offered(tmp_path: Path) -> None:
    # The fixed lines (runtime and sandbox, grammars, worker process) leave too little
    # for any one change; the smallest compute buffer with a short context fits.
    out = laya("plan", str(smol_manifest(tmp_path, "680MiB")))
    assert out.returncode == 1
    assert "models[0].max_step_tokens = 64 together with models[0].max_seq_len = " in out.stdout


def test_systemd_unit_sets_memory_max_from_the_plan(tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text('[[models]]\nname = "smol"\npath = "embedded:smollm2-135m-instruct"\n')
    plan = json.loads(laya("plan", "--json", str(manifest)).stdout)
    unit = laya("plan", "--systemd", str(manifest)).stdout
    line = next(x for x in unit.splitlines() if x.startswith("MemoryMax="))
    memory_max = int(line.removeprefix("MemoryMax=").removesuffix("M")) * 2**20
    # Laya under this unit keeps max(256 MiB, 10%) back from the cgroup limit; the rest must
    # still hold the plan.
    assert memory_max - max(256 * 2**20, memory_max // 10) >= plan["total_bytes"]
    assert memory_max < plan["total_bytes"] + 2**30
    assert "MemorySwapMax=0" in unit and f"serve {manifest.resolve()}" in unit


HOSTILE: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "truncated to 1 MiB": (lambda src, dst: hg.truncated(src, dst, 2**20),
                           "truncated or corrupt: at byte 960195, the 48900 items of "
                           "tokenizer.ggml.merges"),
    "truncated to 100 B": (lambda src, dst: hg.truncated(src, dst, 100), "file size 100 bytes"),
    "truncated to 24 B": (lambda src, dst: hg.truncated(src, dst, 24), "file size 24 bytes"),
    "magic only": (lambda src, dst: hg.truncated(src, dst, 4), "the version would take 4 bytes"),
    "a huge string length": (hg.with_huge_string_length, "would take 4611686018427387904 bytes"),
    "version 999": (lambda src, dst: hg.with_version(src, dst, 999), "GGUF version 999"),
    "head_count 0": (lambda src, dst: hg.with_metadata(
        src, dst, "llama.attention.head_count", 0), "llama.attention.head_count is 0"),
    "epsilon nan": (lambda src, dst: hg.with_metadata(
        src, dst, "llama.attention.layer_norm_rms_epsilon", math.nan, "f32"),
        "llama.attention.layer_norm_rms_epsilon is nan; llama.cpp needs a finite number >= 0"),
    "block_count 1000": (lambda src, dst: hg.with_metadata(src, dst, "llama.block_count", 1000),
                         "llama.block_count is 1000 but the tensor table has 30 layers"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_model_files_exit_2_naming_the_problem(tmp_path: Path, case: str) -> None:
    make, said = HOSTILE[case]
    model = make(hg.embedded(), tmp_path / "model.gguf")
    manifest = tmp_path / "laya.toml"
    manifest.write_text('[[models]]\nname = "m"\npath = "model.gguf"\n')
    for command in ("check", "plan", "serve"):
        out = laya(command, str(manifest))
        assert out.returncode == 2, (command, out.stderr)
        assert f"laya: manifest error: models[0].path: {model}: " in out.stderr, command
        assert said in out.stderr and "Traceback" not in out.stderr, (command, out.stderr)
