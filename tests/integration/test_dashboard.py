"""The live page (laya_core/http/dashboard.py) in a real browser: headless Chromium, the Debian
package (/usr/bin/chromium, which `make test` installs), driven by Playwright, against a live
``laya serve`` of the embedded model with an API key, so the page must ask for one.

Set LAYA_DASHBOARD_SCREENSHOT to a path to keep the screenshot taken under load
(docs/dashboard.png is one).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import pytest
import yaml
from conftest import ServerProcess, serving
from playwright.sync_api import Browser, Page, sync_playwright

from laya_core.units import fmt_bytes

KEY = "sk-dashboard-test"
MANIFEST = f"""
[server]
host = "127.0.0.1"
port = {{port}}
api_keys = ["{KEY}"]

[memory]
budget = "4GiB"

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 512
max_num_seqs = 8
max_queue = 128
# All 64 streams must be served, however long a busy machine keeps the last in the queue.
queue_timeout_s = 600
"""
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = "/usr/bin/chromium"
SPEC = Path(__file__).parents[2] / "spec" / "openapi.yaml"
NUM_STREAMS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(MANIFEST, tmp_path_factory.mktemp("dashboard_server"), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert os.access(CHROMIUM, os.X_OK), \
        f"{CHROMIUM} is missing: sudo apt-get install chromium (make test installs it as root)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(server: ServerProcess, browser: Browser) -> Iterator[Page]:
    """The page, opened without a key: it must ask for one, then show the data."""
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.is_hidden("#main")
    page.fill("#key-input", "not-the-key")
    page.click("#key-form button")
    page.wait_for_selector("#key-error:text('refused')")
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector(".replica[data-model=smollm2][data-replica='0']")
    yield page
    assert not errors, errors
    page.close()


def _snapshot_validator() -> jsonschema.Draft202012Validator:
    components = yaml.safe_load(SPEC.read_text())["components"]
    return jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/LiveSnapshot", "components": components})


SNAPSHOT = _snapshot_validator()


def live(server: ServerProcess) -> dict[str, Any]:
    """GET /live, held to spec/openapi.yaml's LiveSnapshot."""
    r = httpx.get(server.url + "/live", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    SNAPSHOT.validate(r.json())
    return dict(r.json())


def field(page: Page, name: str) -> str:
    return page.inner_text(f".replica[data-model=smollm2][data-replica='0'] "
                           f"[data-field={name}]")


def test_the_page_loads_without_a_key_and_the_data_needs_one(server: ServerProcess,
                                                             page: Page) -> None:
    for path in ("/", "/dashboard", "/dashboard/app.js", "/dashboard/app.css"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and KEY not in r.text, path
    assert "http://" not in httpx.get(server.url + "/").text  # nothing fetched elsewhere
    for path in ("/live", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 401, path
    assert page.evaluate("sessionStorage.getItem('laya-api-key')") == KEY


def test_the_ledger_on_the_page_equals_laya_plan_json(server: ServerProcess, page: Page,
                                                      tmp_path: Path) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(MANIFEST.replace("{port}", str(server.port)))
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "laya_core.cli.main", "plan", "--json", str(manifest)],
        check=True, capture_output=True, text=True).stdout)
    (ledger,) = plan["replicas"]
    replica = ".replica[data-model=smollm2][data-replica='0']"
    for name in ("weights_bytes", "kv_pool_bytes", "overhead_bytes", "total_bytes"):
        cell = page.locator(f"{replica} [data-field={name}]")
        assert int(cell.get_attribute("data-bytes") or -1) == ledger[name], name
    for name, key in (("budget_bytes", "budget_bytes"), ("planned_bytes", "total_bytes"),
                      ("runtime_bytes", "runtime_bytes")):
        cell = page.locator(f"#memory-table [data-field={name}]")
        assert int(cell.get_attribute("data-bytes") or -1) == plan[key], name
    for name in ("weights_bytes", "kv_pool_bytes", "total_bytes"):  # as `laya plan` prints
        assert page.inner_text(f"{replica} [data-field={name}]") == fmt_bytes(ledger[name])
    assert int(field(page, "blocks_total")) == ledger["kv_cache_tokens"] // 16
    rss = int(page.locator(f"{replica} [data-field=rss_bytes]").get_attribute("data-bytes")
              or 0)
    assert 0 < rss < ledger["total_bytes"]  # the worker process's own resident set


def test_a_chat_reply_streams_shows_its_timing_and_stop_frees_the_sequence(
        server: ServerProcess, page: Page) -> None:
    page.fill("#chat-max-tokens", "400")
    page.fill("#chat-input", "Write a long story about a lighthouse keeper.")
    page.click("#chat-send")
    reply = page.locator(".msg.assistant").last
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant .text')"
                           "[document.querySelectorAll('.msg.assistant').length - 1]"
                           ".textContent.length > 10")
    assert live(server)["models"][0]["replicas"][0]["running"] == 1
    page.click("#chat-stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]")
    text = reply.locator(".text").inner_text()
    deadline = time.monotonic() + 30  # generous: the wait ends at the stop
    while live(server)["models"][0]["replicas"][0]["running"] != 0:
        assert time.monotonic() < deadline, "the stopped sequence still runs"
        time.sleep(0.1)
    page.wait_for_timeout(500)
    assert reply.locator(".text").inner_text() == text  # nothing arrived after the stop
    assert len(text) < 400 * 4

    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", "Name three colours.")
    page.click("#chat-send")
    done = page.locator(".msg.assistant[data-state=done]").last
    done.wait_for(timeout=30_000)
    assert done.locator(".text").inner_text().strip()
    timing = done.locator(".timing")
    for layer in ("route", "queue", "prefill", "decode"):
        assert float(timing.get_attribute(f"data-{layer}") or -1) >= 0, layer
    assert "prefill" in timing.inner_text()


def _load(url: str, n: int, done: threading.Event) -> list[int]:
    """``n`` concurrent streamed chats; their status codes."""
    async def one(client: httpx.AsyncClient, i: int) -> int:
        # Lengths differ, so sequences end at different steps and the pool's use moves.
        body = {"model": "smollm2", "stream": True, "max_tokens": 8 + i % 12, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to ten, take {i}."}]}
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers=AUTH) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async def all_of() -> list[int]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(n))))

    try:
        return asyncio.run(all_of())
    finally:
        done.set()


def test_kv_use_rises_under_64_streams_and_falls_back_while_updates_keep_flowing(
        server: ServerProcess, page: Page, tmp_path: Path) -> None:
    done = threading.Event()
    statuses: list[int] = []
    load = threading.Thread(target=lambda: statuses.extend(_load(server.url, NUM_STREAMS, done)))
    load.start()
    used, waiting, updates = [], [], []  # what the page shows, sampled every 0.2 s
    shot = None
    while not done.is_set():
        used.append(int(field(page, "blocks_used")))
        waiting.append(int(field(page, "waiting")))
        updates.append(int(page.get_attribute("#updated", "data-count") or 0))
        if len(used) % 10 == 1:
            live(server)  # a snapshot under load still matches the spec
        if shot is None and used[-1] > 0 and waiting[-1] > 0:
            shot = Path(os.environ.get("LAYA_DASHBOARD_SCREENSHOT", tmp_path / "load.png"))
            page.wait_for_timeout(1500)  # a few polls in, so the sparkline shows the rise
            page.screenshot(path=str(shot), full_page=True)
        page.wait_for_timeout(200)
    load.join()
    assert statuses == [200] * NUM_STREAMS
    assert max(used) > 0 and max(waiting) > 0, (used, waiting)
    assert shot is not None and shot.stat().st_size > 10_000
    # Updates kept flowing under load: the page took several snapshots while it ran. Which
    # values it caught is the machine's: a full pool can read the same at every poll, and the
    # last sequences can end between two polls, so the fall is checked below, not sampled.
    assert updates[-1] - updates[0] >= 3, (updates, used)
    page.wait_for_function(
        "() => document.querySelector(\".replica [data-field=blocks_used]\").textContent === '0'"
        " && document.querySelector(\".replica [data-field=running]\").textContent === '0'",
        timeout=10_000)
    assert page.locator(".latency [data-layer=decode] td").nth(1).inner_text() != "-"


def test_polling_leaves_nothing_behind(server: ServerProcess) -> None:
    """A page polls /live twice a second for as long as it is open: the front end's memory
    must not grow with the polls, on kept-alive connections or fresh ones."""
    front_end = psutil.Process(server.proc.pid)
    with httpx.Client(headers=AUTH, timeout=10) as client:
        def polls(n: int) -> None:
            for _ in range(n):
                assert client.get(server.url + "/live").status_code == 200
        live(server)
        polls(300)
        before = front_end.memory_info().rss
        polls(1500)
        for _ in range(200):  # a new connection each, opened and closed
            assert httpx.get(server.url + "/live", headers=AUTH).status_code == 200
    grown = front_end.memory_info().rss - before
    assert grown < 4 * 2**20, f"the front end grew {grown} bytes over 1700 polls"
