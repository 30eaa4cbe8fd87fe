"""laya_core/logs.py: the names Laya's threads carry where the operating system shows them."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from laya_core.logs import start_named

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread names in /proc are Linux's")


def comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_started_thread_carries_its_os_name() -> None:
    named, go = threading.Event(), threading.Event()
    seen: list[str] = []

    def body() -> None:
        named.wait(10)
        seen.append(comm(threading.get_native_id()))
        go.set()

    thread = start_named(threading.Thread(target=body, daemon=True), "laya-test-name")
    named.set()
    assert go.wait(10)
    thread.join(10)
    assert seen == ["laya-test-name"]


def test_a_long_name_is_cut_to_the_kernels_fifteen_characters() -> None:
    hold = threading.Event()
    thread = start_named(threading.Thread(target=hold.wait, args=(10,), daemon=True),
                         "laya-a-name-longer-than-fifteen")
    try:
        assert comm(thread.native_id) == "laya-a-name-lon"
    finally:
        hold.set()
        thread.join(10)


def test_a_thread_that_ended_is_left_alone() -> None:
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    start_named(thread, "laya-gone")  # its /proc entry is gone: no error
