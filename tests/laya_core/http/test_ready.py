"""/ready answers 200 only once every replica has loaded, and says why not before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from toy_backend import toy_deployment

from laya_core.http import create_app
from laya_core.serving.deployment import Deployment


def deployment(tmp_path: Path, options: list[dict]) -> Deployment:
    return toy_deployment(tmp_path, [{"name": f"toy{i}", "max_seq_len": 32, "max_num_seqs": 1,
                                      "options": o} for i, o in enumerate(options)])


def get(d: Deployment, path: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(d))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.get(path)

    return asyncio.run(go())


def test_ready_waits_for_every_replica(tmp_path: Path) -> None:
    d = deployment(tmp_path, [{}, {"load_delay_s": 0.5}])
    d.start()
    early = get(d, "/ready")
    assert early.status_code == 503 and early.json()["ready"] is False
    assert [r["state"] for r in early.json()["replicas"]][1] == "loading"
    assert get(d, "/health").status_code == 200  # alive while loading
    assert d.wait_ready(10)
    assert get(d, "/ready").status_code == 200
    d.stop()


def test_a_failed_load_keeps_ready_at_503_with_the_reason(tmp_path: Path) -> None:
    d = deployment(tmp_path, [{"fail_load": True}])
    d.start()
    assert not d.wait_ready(10)
    r = get(d, "/ready")
    (replica,) = r.json()["replicas"]
    assert r.status_code == 503 and replica["state"] == "failed"
    assert "weights are unreadable" in replica["error"]
    d.stop()
