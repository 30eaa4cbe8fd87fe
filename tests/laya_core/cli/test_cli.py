"""The ``laya`` command as a user runs it: exit codes and messages, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs the laya command


def laya(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "laya_core.cli.main", *args],
                          capture_output=True, text=True, timeout=60)


def test_plugins_lists_every_family_with_sources() -> None:
    out = laya("plugins")
    assert out.returncode == 0
    for family in ("backend:", "router:", "scheduler:", "cache_policy:"):
        assert family in out.stdout
    assert "llamacpp" in out.stdout and "laya-backend-llamacpp" in out.stdout
    assert "fcfs" in out.stdout and "builtin" in out.stdout


@pytest.mark.parametrize(("body", "key"), [
    ('[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\nmax_seq_len = 0\n',
     "models[0].max_seq_len"),
    ('[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\nbackend = "vllm"\n',
     "models[0].backend"),
    ('[[models]]\nname = "m"\npath = "missing.gguf"\n', "models[0].path"),
    ('[server]\nprot = 1\n[[models]]\nname = "m"\npath = "x"\n', "server.prot"),
    ("[[models]\n", "not valid TOML"),
])
def test_check_reports_the_key_and_exits_2(tmp_path: Path, body: str, key: str) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(body)
    for command in ("check", "serve"):
        out = laya(command, str(manifest))
        assert out.returncode == 2, out.stderr
        assert key in out.stderr
        assert "Traceback" not in out.stderr + out.stdout


def test_check_accepts_a_good_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text('[[models]]\nname = "smol"\npath = "embedded:smollm2-135m-instruct"\n')
    out = laya("check", str(manifest))
    assert out.returncode == 0, out.stderr
    assert "ok: smol" in out.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout


def test_missing_manifest_file_is_a_clear_error(tmp_path: Path) -> None:
    out = laya("check", str(tmp_path / "nowhere.toml"))
    assert out.returncode == 2 and "cannot read manifest" in out.stderr
