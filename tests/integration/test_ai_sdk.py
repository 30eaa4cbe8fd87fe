"""The Vercel AI SDK through Node: its default OpenAI provider (``openai(model)`` speaks the
Responses API) against a real server of the embedded model: ``generateText``,
``streamText``, and tools with a typed answer (``Output.object`` beside a tool, the
agent-with-a-result pattern). The SDK is installed from tests/integration/ai_sdk's lock file
with ``npm ci`` (kept between runs, ignored by git)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerProcess, serving, smollm_manifest

HERE = Path(__file__).parent / "ai_sdk"


@pytest.fixture(scope="module")
def node_sdk() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "the AI SDK test needs Node.js and npm (make test-system-deps)"
    installed = HERE / "node_modules" / ".package-lock.json"
    lock = HERE / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"], cwd=HERE,
                       check=True, timeout=300)
    return Path(node)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(smollm_manifest("llamacpp"), tmp_path_factory.mktemp("ai_sdk")) as s:
        yield s


def test_the_ai_sdk_default_provider_generates_streams_and_answers_in_a_schema(
        node_sdk: Path, server: ServerProcess) -> None:
    run = subprocess.run([str(node_sdk), "check.mjs", server.url, "smollm2"], cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])

    plain = out["plain"]
    assert plain["text"] and plain["finishReason"] in ("stop", "length")
    assert plain["inputTokens"] > 0 and 0 < plain["outputTokens"] <= 16
    # Greedy: the stream says what the plain call said.
    assert out["streamed"] == {"text": plain["text"], "finishReason": plain["finishReason"]}

    typed = out["typed"]
    steps = typed["steps"]
    # The first step may call the tool or answer at once; the last answers in the schema.
    assert steps[-1]["finishReason"] == "stop" and not steps[-1]["toolCalls"]
    answer = typed["output"]
    assert isinstance(answer.get("city"), str) and isinstance(answer.get("population"),
                                                               (int, float)), answer
    assert json.loads(steps[-1]["text"]) == answer
    for step in steps[:-1]:
        assert step["finishReason"] == "tool-calls"
        assert [c["name"] for c in step["toolCalls"]] == ["lookup"]
        assert isinstance(step["toolCalls"][0]["input"]["city"], str)
    assert typed["calls"] == len(steps) - 1
