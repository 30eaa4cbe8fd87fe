"""Two replicas of the embedded model: later turns of a conversation land on the replica that
holds its prefix and reuse it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[router]
impl = "%s"

[[models]]
name = "smollm2"
backend = "%s"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 2048
max_num_seqs = 2
replicas = 2
routing = "%s"
"""
SYSTEM = {"ada": "You are a patient maths tutor. Explain every answer step by step. " * 10,
          "bob": "You are a friendly English teacher. Use short, simple examples. " * 10}
TURNS = {"ada": ["What is a prime number?", "Is 21 prime?", "And 23?"],
         "bob": ["What is a noun?", "Is 'run' a noun?", "And 'happiness'?"]}
# Interleaved so that round robin splits each conversation over both replicas.
ORDER = [("ada", 0), ("ada", 1), ("bob", 0), ("ada", 2), ("bob", 1), ("bob", 2)]


def prefill_ms(response: httpx.Response) -> float:
    parts = dict(p.split(";dur=") for p in response.headers["server-timing"].split(", "))
    return float(parts["queue"]) + float(parts["prefill"])


def converse(url: str) -> tuple[list[float], int]:
    """Two conversations, interleaved; prefill times of later turns, and prefix-cache hits
    over both replicas."""
    history = {user: [{"role": "system", "content": SYSTEM[user]}] for user in TURNS}
    later = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for user, turn in ORDER:
            history[user].append({"role": "user", "content": TURNS[user][turn]})
            r = client.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": history[user], "max_tokens": 12,
                "temperature": 0}, headers={"X-Session-ID": user})
            assert r.status_code == 200, r.text
            history[user].append(r.json()["choices"][0]["message"])
            if turn:
                later.append(prefill_ms(r))
        replicas = client.get("/ready").json()["replicas"]
    return later, sum(r["prefix_cache_hits"] for r in replicas)


# Both routers, on llama.cpp: the backend decides nothing here but what a replica's prefix
# cache holds, which the conformance suite checks on each backend.
@pytest.mark.parametrize(("impl", "backend"), [("cpp", "llamacpp"), ("python", "llamacpp")])
def test_prefix_routing_reuses_every_later_turn(tmp_path: Path, impl: str,
                                                backend: str) -> None:
    results = {}
    for policy in ("prefix", "round_robin"):
        (tmp_path / policy).mkdir()
        server = ServerProcess(MANIFEST % (impl, backend, policy), tmp_path / policy)
        try:
            server.wait_ready()
            results[policy] = converse(server.url)
        finally:
            assert server.stop() == 0, server.log()
    later, hits = results["prefix"]
    rr_later, rr_hits = results["round_robin"]
    print(f"\n[{impl}, {backend}] later turns' queue+prefill: prefix routing "
          f"{sum(later) / len(later):.0f} ms avg ({hits} prefix hits), round robin "
          f"{sum(rr_later) / len(rr_later):.0f} ms avg ({rr_hits} prefix hits)")
    assert hits == 4  # turns 2 and 3 of both conversations found their prefix
