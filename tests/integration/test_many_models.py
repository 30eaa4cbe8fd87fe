"""Many models under one budget, on a real server with real worker processes: four names
over the embedded model, all loaded on demand, with a budget that holds two. A bounded,
concurrent, mixed run of requests across all four answers each with 200 (or 503 with
Retry-After, only when a wait for room ran out), while the server's whole process tree,
sampled every 100 ms, stays within the budget, and the models loaded never hold more than
it by the plan. Then an asked unload waits for the stream running on its model, and the
API says each model's status and what happened to it."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import threading
import time
from pathlib import Path

import httpx
import psutil
from conftest import serving

from laya_core.config import manifest as mf
from laya_core.memory.planner import make_plan
from laya_core.plugins import load_registry

NAMES = ("a", "b", "c", "d")


def entries(names: tuple[str, ...] = NAMES) -> str:
    return "".join(f"""
[[models]]
name = "{name}"
backend = "llamacpp"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 256
max_num_seqs = 2
load = "on_demand"

[models.options]
n_threads = 1
""" for name in names)


def budget_for_two() -> tuple[int, int, int]:
    """(budget, runtime, one model's planned bytes): room for the runtime and two."""
    registry = load_registry()
    plan = make_plan(mf.resolve(mf.from_dict({"models": [
        {"name": n, "backend": "llamacpp", "path": "embedded:smollm2-135m-instruct",
         "max_seq_len": 256, "max_num_seqs": 2, "load": "on_demand",
         "options": {"n_threads": 1}} for n in NAMES]}), registry), registry, serving=True)
    one = plan.model_bytes("a")
    return plan.runtime_bytes + 2 * one + one // 2, plan.runtime_bytes, one


class TreeSampler(threading.Thread):
    """The resident set of a process and all its descendants, every 100 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            total = 0
            for proc in [self.root, *self.root.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    pass  # a worker that exited between the listing and the read
            self.peak = max(self.peak, total)
            self.samples += 1


def models(url: str) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}


def test_four_models_in_the_room_of_two(tmp_path: Path) -> None:
    budget, runtime, one = budget_for_two()
    manifest = (f'[server]\nhost = "127.0.0.1"\nport = {{port}}\n\n'
                f"[memory]\nbudget = {budget}\n" + entries())
    with serving(manifest, tmp_path) as server:
        assert {m["status"] for m in models(server.url).values()} == {"unloaded"}
        ready = httpx.get(f"{server.url}/ready").json()  # ready, with nothing loaded
        assert ready["ready"] and {r["state"] for r in ready["replicas"]} == {"unloaded"}
        sampler = TreeSampler(server.proc.pid)
        sampler.start()
        stop_watch = threading.Event()
        planned_peak = [0]

        def watch_plan() -> None:  # what the API says is loaded, by the plan
            while not stop_watch.wait(0.05):
                loaded = [m for m in models(server.url).values() if m["status"] == "loaded"]
                planned_peak[0] = max(planned_peak[0], runtime + sum(
                    int(m["planned_bytes"]) for m in loaded))  # type: ignore[call-overload]

        watcher = threading.Thread(target=watch_plan, daemon=True)
        watcher.start()
        rng = random.Random(7)
        order = [rng.choice(NAMES) for _ in range(24)]

        def ask(name: str) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": name, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": f"Say {name}."}]})

        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(ask, order))
        finally:
            stop_watch.set()
            watcher.join()
            sampler.done.set()
            sampler.join()
        for r in answers:
            if r.status_code == 503:
                assert r.headers["retry-after"], r.text
                assert r.json()["error"]["code"] in ("no_room", "queue_timeout"), r.text
            else:
                assert r.status_code == 200, r.text
        assert sum(r.status_code == 200 for r in answers) >= len(answers) // 2
        loaded = [r for r in answers if "load;dur=" in r.headers.get("server-timing", "")]
        assert loaded, "no request waited for a load"
        assert sampler.samples > 0 and sampler.peak <= budget, (sampler.peak, budget)
        assert planned_peak[0] <= budget, (planned_peak[0], budget)
        cards = models(server.url)
        print(f"\n{len(answers)} requests: {sum(r.status_code == 200 for r in answers)} "
              f"answered 200; process tree peak {sampler.peak / 2**20:.0f} MiB, planned peak "
              f"{planned_peak[0] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB; loads "
              f"{ {n: c['loads'] for n, c in cards.items()} }, unloads "
              f"{ {n: c['unloads'] for n, c in cards.items()} }")
        assert sum(int(c["loads"]) for c in cards.values()) > 2  # type: ignore[call-overload]
        assert any(c["unloads"] for c in cards.values()), cards  # some were evicted
        assert all(c["planned_bytes"] == one for c in cards.values())

        # An asked unload waits for the stream running on its model, then answers.
        name = next(n for n, c in cards.items() if c["status"] == "loaded")
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": name, "max_tokens": 60, "stream": True, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": "Count."}]}) as s:
            lines = s.iter_lines()
            next(lines)
            unload = concurrent.futures.ThreadPoolExecutor(1).submit(
                httpx.post, f"{server.url}/models/unload", json={"model": name}, timeout=120)
            while models(server.url)[name]["status"] != "unloading":
                assert not unload.done(), unload.result().text
                time.sleep(0.02)
            chunks = [json.loads(line[6:]) for line in lines
                      if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # never cut
        answer = unload.result()
        assert answer.status_code == 200 and answer.json()["status"] == "unloaded"
        assert models(server.url)[name]["unloads"]["asked"] == 1  # type: ignore[index]
        metrics = httpx.get(f"{server.url}/metrics").text
        scraped = sum(float(v) for v in re.findall(
            r'^laya:model_loads_total\{model_name="[a-d]"\} (\S+)$', metrics, re.M))
        assert scraped == sum(int(c["loads"]) for c in models(server.url).values())  # type: ignore[call-overload]
        asked = f'laya:model_unloads_total{{model_name="{name}",reason="asked"}} 1.0'
        assert asked in metrics.splitlines(), metrics
        live = {m["name"]: m for m in httpx.get(f"{server.url}/live").json()["models"]}
        assert live[name]["load"] == "on_demand"
        assert live[name]["residency"]["status"] == "unloaded"
        assert live[name]["residency"]["unloads"]["asked"] == 1
        pinned = httpx.post(f"{server.url}/models/load", json={"model": "zz"})
        assert pinned.status_code == 404 and pinned.json()["error"]["param"] == "model"


def test_the_page_shows_an_on_demand_models_state(tmp_path: Path) -> None:
    """The live page in a real browser: the model's state and loads, as they change."""
    import os

    from playwright.sync_api import sync_playwright

    chromium = "/usr/bin/chromium"  # as tests/integration/test_dashboard.py drives it
    assert os.access(chromium, os.X_OK), f"{chromium} is missing (make test installs it)"
    manifest = '[server]\nhost = "127.0.0.1"\nport = {port}\n' + entries(("a",))
    with serving(manifest, tmp_path) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            status = ".model[data-model=a] [data-field=residency_status]"
            page.wait_for_selector(f"{status}:text('unloaded')")
            assert httpx.post(f"{server.url}/models/load", json={"model": "a"},
                              timeout=120).status_code == 200
            page.wait_for_selector(f"{status}:text-is('loaded')", timeout=30_000)
            assert page.text_content(".model[data-model=a] [data-field=loads]") == "1"
        finally:
            browser.close()
