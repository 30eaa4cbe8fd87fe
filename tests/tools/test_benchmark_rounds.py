"""tools/benchmark_rounds.py: alternating fresh servers, medians and per-round ratios."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmark_rounds.py"
spec = importlib.util.spec_from_file_location("benchmark_rounds", TOOL)
assert spec and spec.loader
rounds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rounds)


def level(tokens_per_s: float, ttft: float) -> dict:
    return {"output_tokens_per_s": tokens_per_s, "ttft_ms": {"p50": ttft}, "failed": 0}


def test_ratios_pair_each_round_with_the_baselines_same_round() -> None:
    runs = [{"round": 1, "server": "a", "levels": {8: level(100.0, 50)}},
            {"round": 1, "server": "b", "levels": {8: level(120.0, 40)}},
            {"round": 2, "server": "a", "levels": {8: level(80.0, 70)}},
            {"round": 2, "server": "b", "levels": {8: level(88.0, 60)}},
            {"round": 3, "server": "a", "levels": {8: level(90.0, 60)}},
            {"round": 3, "server": "b", "levels": {8: level(99.0, 50)}}]
    b = rounds.summarize(runs, "a")["b"]["8"]
    assert b["ratio_to_a"] == [1.2, 1.1, 1.1]  # not 99/90 against a's median
    assert b["median_ratio_to_a"] == 1.1 and b["median_tokens_per_s"] == 99.0
    assert b["median_ttft_p50_ms"] == 50


def test_decode_rates_have_their_own_ratios() -> None:
    def timed(tokens_per_s: float, decode: float) -> dict:
        return {**level(tokens_per_s, 50), "decode_tokens_per_s": decode}

    runs = [{"round": 1, "server": "plain", "levels": {1: timed(90.0, 100.0)}},
            {"round": 1, "server": "ngram", "levels": {1: timed(126.0, 160.0)}},
            {"round": 2, "server": "plain", "levels": {1: timed(72.0, 80.0)}},
            {"round": 2, "server": "ngram", "levels": {1: timed(104.0, 124.0)}}]
    s = rounds.summarize(runs, "plain")["ngram"]["1"]
    assert s["ratio_to_plain"] == [1.4, 1.444]
    assert s["decode_tokens_per_s"] == [160.0, 124.0]
    assert s["decode_ratio_to_plain"] == [1.6, 1.55]
    assert s["median_decode_ratio_to_plain"] == pytest.approx(1.575)
    # Runs from before the rate was recorded get no decode entries, rather than a wrong one.
    old = [{"round": 1, "server": "a", "levels": {1: level(1.0, 1)}}]
    assert "decode_ratio_to_a" not in rounds.summarize(old, "a")["a"]["1"]


def test_settle_waits_for_the_load_to_fall_and_gives_up_at_the_limit() -> None:
    loads, naps = iter([2.0, 1.4, 0.9, 0.4]), []
    waited = rounds.settle(0.5, 300.0, loadavg=lambda: (next(loads), 0.0, 0.0),
                           sleep=naps.append)
    assert (waited, naps) == (15.0, [5.0, 5.0, 5.0])
    naps.clear()
    assert rounds.settle(0.5, 10.0, loadavg=lambda: (3.0, 0.0, 0.0), sleep=naps.append) == 10.0
    assert rounds.settle(5.0, 10.0) == 0.0  # this machine's own load, already under 5


def test_two_laya_configurations_in_one_round(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    run = subprocess.run(
        [sys.executable, str(TOOL), "--laya", "defaults", "--laya", 'one:{"n_threads": 1}',
         "--rounds", "1", "--concurrency", "1", "--requests", "2", "--max-tokens", "8",
         "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["server"] for r in result["rounds"]] == ["defaults", "one"]
    one = result["summary"]["one"]["1"]
    assert one["failed"] == 0 and one["median_tokens_per_s"] > 0
    assert len(one["ratio_to_defaults"]) == 1
    assert "ratio to defaults" in run.stdout
    assert result["machine"]["cpus"] >= 1 and result["machine"]["cpu"]
    assert result["rounds"][0]["levels"]["1"]["load_before"] >= 0
    assert result["rounds"][0]["levels"]["1"]["ready_s"] > 0
    assert one["decode_tokens_per_s"][0] > 0 and len(one["decode_ratio_to_defaults"]) == 1


def test_a_spec_splits_into_the_model_table_and_its_options(tmp_path: Path) -> None:
    import tomllib

    server = rounds.laya_server('tuned:{"max_num_seqs": 16, "max_seq_len": 1024, '
                                '"n_threads": 2, "engine": "thread"}', tmp_path)
    manifest = tomllib.loads((tmp_path / "tuned.toml").read_text())
    (model,) = manifest["models"]
    assert (model["max_num_seqs"], model["max_seq_len"]) == (16, 1024)
    assert model["options"] == {"n_threads": 2}
    assert manifest["cluster"]["engine"] == "thread" and server.name == "tuned"
    other = rounds.laya_server('awq:{"backend": "torch", "path": "/models/awq"}', tmp_path)
    assert tomllib.loads((tmp_path / "awq.toml").read_text())["models"][0]["path"] == \
        "/models/awq" and other.name == "awq"
    plain = tomllib.loads((rounds.laya_server("defaults", tmp_path) and
                           (tmp_path / "defaults.toml")).read_text())["models"][0]
    assert "max_num_seqs" not in plain and "max_seq_len" not in plain  # Laya's own defaults


def test_llama_server_configurations_name_their_flags() -> None:
    defaults = rounds.llama_server("/bin/llama-server", "m.gguf", "llama-defaults=",
                                   "--no-repack")
    tuned = rounds.llama_server("/bin/llama-server", "m.gguf", "np8=-np 8 -c 16384")
    assert defaults.name == "llama-defaults" and defaults.argv[-1] == "--no-repack"
    assert "-np" not in defaults.argv
    assert tuned.name == "np8" and tuned.argv[-4:] == ["-np", "8", "-c", "16384"]
