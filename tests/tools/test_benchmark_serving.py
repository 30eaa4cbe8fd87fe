"""tools/benchmark_serving.py run as a user would against a real server; its stream parsing."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from conftest import ServerProcess, free_port

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmark_serving.py"


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_serving", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


bench = load_tool()


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, str(TOOL), *args], check=False, capture_output=True,
                         text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def run_tool(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the tool; its result and the JSON summary on its last line."""
    out = tool(*args)
    return out, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.model
def test_two_levels_against_a_real_server(smollm_server: ServerProcess, tmp_path: Path) -> None:
    out, summary = run_tool("--url", smollm_server.url, "--model", "smollm2",
                            "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8",
                            "--prompt-set", "short", "--out", str(tmp_path / "res" / "bench"))
    assert out.returncode == 0, out.stderr
    assert [lv["concurrency"] for lv in summary["levels"]] == [1, 2]
    for level in summary["levels"]:
        assert (level["ok"], level["failed"], level["errors"]) == (4, 0, {})
        assert set(level["finish_reasons"]) <= {"length", "stop"}
        assert 0 < level["output_tokens"] <= 4 * 8 and level["output_tokens_per_s"] > 0
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p90"] <= level["ttft_ms"]["p99"]
        assert level["itl_ms"]["p50"] > 0
        assert level["e2e_ms"]["p50"] >= level["ttft_ms"]["p50"] * 0.5
        assert level["tpot_ms"]["p50"] > 0 and level["decode_tokens_per_s"] > 0
    saved = json.loads(Path(summary["json"]).read_text())
    assert summary["json"] == str(tmp_path / "res" / "bench.json")
    for level in saved["levels"]:
        assert len(level["raw"]) == 4
        assert all(r["ok"] and r["tokens_from_usage"] and 0 < r["output_tokens"] <= 8
                   for r in level["raw"])
    if importlib.util.find_spec("matplotlib"):
        assert Path(summary["plot"]).is_file()
    else:
        assert summary["plot"] is None and "needs matplotlib" in out.stdout


@pytest.mark.model
def test_unknown_model_is_counted_as_http_404(smollm_server: ServerProcess) -> None:
    out, summary = run_tool("--url", f"{smollm_server.url}/v1", "--model", "nope",
                            "--requests", "2", "--max-tokens", "4")
    assert out.returncode == 1
    assert summary["levels"][0]["errors"] == {"http_404": 2}


def test_unreachable_url_counts_connection_errors_and_fails() -> None:
    out, summary = run_tool("--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                            "--concurrency", "2", "--requests", "3", "--timeout", "5")
    assert out.returncode == 1
    (level,) = summary["levels"]
    assert (level["ok"], level["failed"], level["errors"]) == (0, 3, {"connection": 3})
    assert level["output_tokens"] == 0 and level["ttft_ms"]["p50"] is None
    out, summary = run_tool("--url", f"http://127.0.0.1:{free_port()}")  # no --model to look up
    assert out.returncode == 2 and "pass --model" in summary["error"]


def test_bad_arguments_exit_2() -> None:
    for args in (["--url", "127.0.0.1:8000"], ["--url", "http://x", "--concurrency", "1,0"]):
        assert tool(*args).returncode == 2


def sse(*events: str) -> str:
    return "".join(f"data: {e}\n\n" for e in events)


def chunk(content: str | None = None, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": content},
                                    "finish_reason": finish}]})


def fake_request(reply: Callable[[httpx.Request], Any], timeout_s: float = 5.0) -> Any:
    async def go() -> Any:
        result = bench.RequestResult(0, 0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            await bench.run_request(client, "http://test/v1/chat/completions", {}, result,
                                    timeout_s)
        return result
    return asyncio.run(go())


def streaming(text: str, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, text=text)


def test_stream_without_usage_counts_content_chunks() -> None:
    r = fake_request(streaming(sse(chunk("a"), chunk(""), chunk("b"), chunk("c", "length"),
                                   "[DONE]")))
    assert r.ok and r.error is None
    assert (r.output_tokens, r.tokens_from_usage, len(r.itl_s)) == (3, False, 2)
    assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s


def test_usage_chunk_sets_the_token_count() -> None:
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}})
    r = fake_request(streaming(sse(chunk("ab"), chunk("c", "stop"), usage, "[DONE]")))
    assert r.ok and (r.output_tokens, r.prompt_tokens, r.num_chunks) == (5, 9, 2)
    assert r.finish_reason == "stop"


def test_done_without_finish_reason_is_ok_but_marked() -> None:
    r = fake_request(streaming(sse(chunk("a"), "[DONE]")))
    assert r.ok and r.finish_reason is None and r.output_tokens == 1


@pytest.mark.parametrize(("reply", "kind"), [
    (streaming('{"error": {"message": "busy"}}', 503), "http_503"),
    (streaming(sse(chunk("a"), "{not json")), "bad_stream"),
    (streaming(sse(chunk("a"))), "bad_stream"),  # neither [DONE] nor a finish_reason
    (streaming(sse(chunk("a"), '{"error": {"message": "engine failed"}}')), "stream_error"),
    (streaming(sse("[1, 2]")), "bad_stream"),
])
def test_failures_are_sorted_by_kind(reply: Callable[[httpx.Request], httpx.Response],
                                     kind: str) -> None:
    r = fake_request(reply)
    assert not r.ok and r.error == kind and r.detail


def test_a_silent_server_is_a_timeout() -> None:
    async def silent(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("the request should have timed out")

    r = fake_request(silent, timeout_s=0.2)
    assert (r.ok, r.error) == (False, "timeout")  # not the handler's AssertionError


def test_tpot_and_decode_rate_leave_out_the_first_token() -> None:
    def done(tokens: int, ttft: float | None, e2e: float) -> Any:
        return bench.RequestResult(0, 0, ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)

    # 2 s to the first of 11 tokens, then 1 s for 10; 1 s to the first of 5, then 2 s for 4.
    results = [done(11, 2.0, 3.0), done(5, 1.0, 3.0), done(1, 0.5, 0.6), done(0, None, 1.0)]
    assert [r.tpot_s for r in results] == [0.1, 0.5, None, None]
    level = bench.summarize(1, results, wall_s=7.6)
    assert level["tpot_ms"] == {"p50": 300.0, "p99": 496.0}
    assert level["decode_tokens_per_s"] == round(14 / 3, 2)  # 10 + 4 tokens in 1 + 2 s
    assert level["output_tokens_per_s"] == round(17 / 7.6, 2)  # the first tokens count here
    assert bench.summarize(1, results[2:], wall_s=1.0)["decode_tokens_per_s"] is None


def test_percentiles_interpolate_and_report_ms() -> None:
    assert bench.percentiles([0.001, 0.002, 0.003, 0.004], (50, 99)) == {"p50": 2.5, "p99": 3.97}
    assert bench.percentiles([], (50,)) == {"p50": None}


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_url_with_or_without_v1(url: str) -> None:
    assert bench._chat_url(url) == "http://h:1/v1/chat/completions"
