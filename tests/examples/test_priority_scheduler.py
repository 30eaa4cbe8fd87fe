"""The example scheduler plugin (examples/laya-priority-scheduler), installed as an outside
author's package is: listed by ``laya plugins`` with its package and version, chosen by a
manifest, and serving a higher tier first under load, where fcfs serves arrival order."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM_MANIFEST, serving

# One sequence at a time, so that every later request waits and the scheduler's admission
# order is the order they finish in.
MANIFEST = SMOLLM_MANIFEST.replace("max_num_seqs = 8", "max_num_seqs = 1") \
    + 'scheduler = "%s"\nmax_queue = 16\n'


def test_laya_plugins_lists_it_with_its_package_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plugins"], check=True,
                         capture_output=True, text=True).stdout
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == ["priority"]]
    assert "laya-priority-scheduler 0.1.0" in line, out


async def finishing_order(url: str) -> list[str]:
    """A request that occupies the one slot, four of tier 5 queued behind it, then one of
    tier 0 by the X-Priority header and one of tier 0 in the body: the order they finish."""
    done: list[str] = []

    async def ask(client: httpx.AsyncClient, name: str, tokens: int,
                  headers: dict[str, str] | None = None, **body: object) -> None:
        r = await client.post("/v1/completions", headers=headers, json={
            "model": "smollm2", "prompt": f"Request {name}: once upon a time",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        done.append(name)

    async def queued(client: httpx.AsyncClient, n: int) -> None:
        """Until the slot is taken and ``n`` requests wait."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            (replica,) = (await client.get("/ready")).json()["replicas"]
            if replica["running"] == 1 and replica["waiting"] >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the slot was not taken with {n} requests waiting")

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks = [asyncio.create_task(ask(client, "first", 64))]
        await queued(client, 0)
        for i in range(4):
            tasks.append(asyncio.create_task(ask(client, f"low{i}", 8, priority=5)))
            await queued(client, i + 1)
        tasks.append(asyncio.create_task(ask(client, "high-header", 8, {"X-Priority": "0"})))
        await queued(client, 5)
        tasks.append(asyncio.create_task(ask(client, "high-body", 8, priority=-1)))
        await asyncio.gather(*tasks)
    return done


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_the_higher_tier_is_served_first_under_load(tmp_path: Path, scheduler: str) -> None:
    with serving(MANIFEST % scheduler, tmp_path) as server:
        order = asyncio.run(finishing_order(server.url))
    print(f"\n{scheduler}: {order}")
    assert order[0] == "first"  # running already: nothing is preempted
    if scheduler == "fcfs":
        assert order[1:] == ["low0", "low1", "low2", "low3", "high-header", "high-body"]
    else:  # tier -1, then tier 0, then tier 5 in arrival order
        assert order[1:] == ["high-body", "high-header", "low0", "low1", "low2", "low3"]


def test_a_bad_x_priority_header_names_itself(tmp_path: Path) -> None:
    with serving(MANIFEST % "priority", tmp_path) as server:
        r = httpx.post(f"{server.url}/v1/completions", headers={"X-Priority": "urgent"},
                       json={"model": "smollm2", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Priority", r.text
