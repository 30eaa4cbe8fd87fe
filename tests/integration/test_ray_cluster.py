"""``[cluster] engine = "ray"`` on a real two-node Ray cluster started here: ``laya plan``
places the replicas per node, ``laya serve`` puts one replica of the embedded model on each
node (each node's ``memory`` resource holds one replica's ledger, not two), the OpenAI
client's chat and streamed completion pass, a conversation's later turns reuse the prefix
its replica holds, and a replica whose actor is killed mid-stream ends that stream with an
error while the other serves and Ray brings the killed one back. A LoRA adapter loaded
while serving reaches both actors, answers as itself from each, and unloads from both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray  # in the test extras: this module must run in CI, never skip
from conftest import ServerProcess
from ray.cluster_utils import Cluster

from laya_core.config import manifest as mf
from laya_core.memory import planner
from laya_core.plugins import load_registry

# serial: two Ray nodes of one CPU each restart a killed actor in time only on free cores.
pytestmark = [pytest.mark.model, pytest.mark.serial]

MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[cluster]
engine = "ray"

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 512
max_num_seqs = 2
replicas = %d
max_loras = 1
max_lora_rank = 8

[models.options]
n_threads = 1
"""
OBJECT_STORE_BYTES = 80 * 2**20  # Ray's minimum; nothing large crosses it here


def ledger_bytes() -> int:
    """One replica's planned bytes: what its actor asks of a node's ``memory``."""
    registry = load_registry()
    text = (MANIFEST % 2).replace("{port}", "1")
    plan = planner.make_plan(mf.build(tomllib.loads(text), registry), registry, serving=True)
    return plan.replicas[0].total_bytes


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two nodes of one CPU each whose ``memory`` resource takes one replica, not two."""
    memory = int(ledger_bytes() * 1.5)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "memory": memory, "object_store_memory": OBJECT_STORE_BYTES})
    c.add_node(num_cpus=1, memory=memory, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(MANIFEST % 2, tmp_path_factory.mktemp("ray"),
                      env={"RAY_ADDRESS": cluster.address})
    try:
        s.wait_ready(180)
        yield s
    finally:
        code = s.stop()
        assert code == 0, s.log()


def actors() -> dict[int, Any]:
    """The server's replica actors by replica id (named laya-MODEL-REPLICA-PID)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("laya-smollm2-"):
            out[int(a["name"].split("-")[2])] = ray.get_actor(a["name"], a["namespace"])
    return out


def test_plan_places_a_replica_per_node_and_refuses_one_that_fits_none(
        cluster: Cluster, tmp_path: Path) -> None:
    for replicas, code in ((2, 0), (3, 1)):
        path = tmp_path / f"laya{replicas}.toml"
        path.write_text((MANIFEST % replicas).replace("{port}", "8000"))
        done = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", str(path)],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "RAY_ADDRESS": cluster.address})
        print(done.stdout[-800:])
        assert done.returncode == code, done.stdout + done.stderr
        assert "ray cluster at" in done.stdout and "2 node(s)" in done.stdout
        placed = [line for line in done.stdout.splitlines() if "-> node" in line]
        assert len(placed) == 2 and len({line.split("-> node")[1] for line in placed}) == 2
        assert ("FITS NO NODE" in done.stdout) == (replicas == 3)


def test_replicas_land_on_different_nodes(cluster: Cluster, server: ServerProcess) -> None:
    found = actors()
    assert sorted(found) == [0, 1]
    nodes = {ray.get(a.loaded.remote())[2] for a in found.values()}
    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    replicas = httpx.get(f"{server.url}/ready").json()["replicas"]
    assert {r["runtime"]["node"] for r in replicas} == nodes  # /ready says where each runs
    assert {r["runtime"]["process"] for r in replicas} == {"ray actor"}


def test_openai_chat_and_streamed_completion(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage is not None
    chunks = list(client.completions.create(model="smollm2", prompt="One, two, three,",
                                            max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_an_adapter_loaded_while_serving_reaches_every_actor(server: ServerProcess) -> None:
    """The load message goes to each replica's actor (all or none); requests naming the
    adapter then answer as it on either node; an unload takes it from both."""
    from lora_adapters import ANSWER, QUESTIONS, cached_adapters

    def adapters_per_replica() -> list[set[str]]:
        replicas = httpx.get(f"{server.url}/ready").json()["replicas"]
        return [set(r["runtime"].get("lora", {})) for r in replicas]

    body = {"lora_name": "pirate", "lora_path": str(cached_adapters()["pirate.gguf"])}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "loaded", r.text
    assert adapters_per_replica() == [{"pirate"}, {"pirate"}]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    for question in QUESTIONS:
        chat = client.chat.completions.create(
            model="pirate", messages=[{"role": "user", "content": question}],
            max_tokens=12, temperature=0)
        assert (chat.choices[0].message.content or "").startswith(ANSWER[:10]), question
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "pirate"},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert adapters_per_replica() == [set(), set()]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="pirate", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])


def test_later_turns_reach_the_replica_holding_the_prefix(server: ServerProcess) -> None:
    def hits() -> int:
        return sum(r["prefix_cache_hits"] for r in httpx.get(f"{server.url}/ready").json()
                   ["replicas"])

    before = hits()
    history = [{"role": "system", "content": "You are a patient maths tutor. " * 12}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for turn in ("What is a prime?", "Is 21 prime?", "And 23?"):
            history.append({"role": "user", "content": turn})
            r = http.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": history, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            history.append(r.json()["choices"][0]["message"])
    assert hits() - before == 2  # turns 2 and 3 found their prefix on one replica


def test_a_killed_actor_ends_its_stream_and_the_other_replica_serves(
        server: ServerProcess) -> None:
    body = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        busy = [i for i, s in enumerate(httpx.get(f"{server.url}/ready").json()["replicas"])
                if s["running"]]
        assert len(busy) == 1
        ray.kill(actors()[busy[0]], no_restart=False)
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert any("error" in e for e in events), events[-3:]
    for _ in range(3):  # the other replica takes every request now
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": "smollm2", "prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60  # Ray restarts the actor, which loads and rejoins
    while httpx.get(f"{server.url}/ready").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{server.url}/ready").text
        time.sleep(0.5)
