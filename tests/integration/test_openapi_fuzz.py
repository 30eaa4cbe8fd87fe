"""Fuzz the API described by spec/openapi.yaml against a live server with schemathesis.

No input may produce a 5xx or a response that breaks the spec. The server has a short
context (64 tokens) so every generated request that is valid finishes quickly; the spec's
model names are narrowed to the served one so the fuzzer reaches past the 404.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from conftest import ServerProcess

SPEC = Path(__file__).parents[2] / "spec" / "openapi.yaml"
MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 64
max_num_seqs = 4
max_queue = 256
"""
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


def served_spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load(SPEC.read_text())
    schemas = spec["components"]["schemas"]
    for name in ("ChatRequest", "CompletionRequest"):
        schemas[name]["allOf"][1]["properties"]["model"] = {"enum": ["smollm2"]}
    for path in ("/tokenize", "/detokenize"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"]["properties"]["model"] = {"enum": ["smollm2"]}
    out = tmp_path / "openapi.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out


def test_fuzzing_finds_no_server_error_and_no_schema_break(tmp_path: Path) -> None:
    server = ServerProcess(MANIFEST, tmp_path)
    try:
        server.wait_ready()
        st = Path(sys.executable).with_name("st")
        run = subprocess.run(
            [str(st), "run", str(served_spec(tmp_path)), "--url", server.url,
             "--max-examples", "25", "--checks", CHECKS, "--request-timeout", "60",
             "--seed", "20261129", "--no-color", "--workers", "1"],
            capture_output=True, text=True, timeout=600)
    finally:
        code = server.stop()
    summary = run.stdout[-3000:]
    print(summary)
    assert run.returncode == 0, summary
    assert code == 0, server.log()
