"""Fuzz the API described by spec/openapi.yaml against a live server with schemathesis.

No input may produce a 5xx or a response that breaks the spec. The server has a short
context (64 tokens) so every generated request that is valid finishes quickly; the spec's
model names are narrowed to the served one so the fuzzer reaches past the 404. Generated
bodies are spiked with hostile values by fuzz_hooks.py, and the bodies that once broke the
server are sent as they are, each needing a 400 that names its field.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ServerProcess
from fuzz_hooks import splice

SPEC = Path(__file__).parents[2] / "spec" / "openapi.yaml"
HOOKS = Path(__file__).with_name("fuzz_hooks.py")
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
    schemas["ResponsesRequest"]["properties"]["model"] = {"enum": ["smollm2"]}
    schemas["AnthropicConversation"]["properties"]["model"] = {"enum": ["smollm2"]}
    for path in ("/tokenize", "/detokenize"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"]["properties"]["model"] = {"enum": ["smollm2"]}
    out = tmp_path / "openapi.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(MANIFEST, tmp_path_factory.mktemp("fuzz_server"))
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_fuzzing_finds_no_server_error_and_no_schema_break(server: ServerProcess,
                                                           tmp_path: Path) -> None:
    st = Path(sys.executable).with_name("st")
    run = subprocess.run(
        [str(st), "run", str(served_spec(tmp_path)), "--url", server.url,
         "--max-examples", "25", "--checks", CHECKS, "--request-timeout", "60",
         "--seed", "20261129", "--no-color", "--workers", "1"],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)})
    summary = run.stdout[-3000:]
    print(summary)
    assert run.returncode == 0, summary


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
TOKENIZE = {"model": "smollm2", "prompt": "Hi"}
DEEP = "[" * 10_000 + "]" * 10_000


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", splice(CHAT, "messages", '[{"role": "user", "content": '
                                    '"a\\ud800"}]'), "messages[0].content"),
    ("/v1/completions", splice(COMPLETION, "prompt", '"a\\ud800"'), "prompt"),
    ("/tokenize", splice(TOKENIZE, "prompt", '"a\\ud800"'), "prompt"),
    ("/v1/completions", splice(COMPLETION, "user", '"\\ud800"'), "user"),
    ("/v1/chat/completions", splice(CHAT, "user", '"\\udc00"'), "user"),
    ("/v1/completions", splice(COMPLETION, "prompt", DEEP), "body"),
    ("/v1/chat/completions", splice(CHAT, "messages", "[" * 70 + "]" * 70), "messages"),
    ("/v1/completions", splice(COMPLETION, "temperature", "1" + "0" * 400), "temperature"),
    ("/v1/completions", splice(COMPLETION, "top_p", "1e400"), "top_p"),
    ("/v1/completions", splice(COMPLETION, "presence_penalty", "NaN"), "presence_penalty"),
    ("/v1/chat/completions", splice(CHAT, "repetition_penalty", "Infinity"),
     "repetition_penalty"),
    ("/v1/chat/completions", splice(CHAT, "max_completion_tokens", "0"),
     "max_completion_tokens"),
    ("/v1/completions", splice(COMPLETION, "top_k", str(2**40)), "top_k"),
    ("/v1/completions", splice(COMPLETION, "seed", str(2**32 - 1)), "seed"),
    ("/detokenize", splice({"model": "smollm2"}, "tokens", "[" + "9" * 30 + "]"), "tokens[0]"),
])
def test_hostile_bodies_get_a_400_naming_the_field(server: ServerProcess, path: str,
                                                   body: bytes, param: str) -> None:
    r = httpx.post(server.url + path, content=body,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["code"], error
    assert "unhandled error" not in server.log()
