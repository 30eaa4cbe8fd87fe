"""Clients that declare a body and then trickle it, or never send it, are cut off."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM_MANIFEST, ServerProcess, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    manifest = SMOLLM_MANIFEST.replace('port = {port}\n', 'port = {port}\nbody_timeout_s = 1\n')
    with serving(manifest, Path(tmp_path_factory.mktemp("slow_clients"))) as s:
        yield s


def send_slowly(server: ServerProcess, parts: list[bytes], gap_s: float) -> tuple[bytes, int]:
    """Send the request's parts with a pause between them until the server answers or hangs
    up; its answer, and how many parts it had been sent by then."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        for part in parts:
            if select.select([conn], [], [], 0)[0]:  # an answer, or the server hung up
                break
            try:
                conn.sendall(part)
            except OSError:  # the server hung up: what it said is still there to read
                break
            sent += 1
            time.sleep(gap_s)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer, sent


HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\nConnection: close\r\n\r\n")


def test_a_body_that_never_comes_gets_408(server: ServerProcess) -> None:
    answer, _ = send_slowly(server, [HEAD], gap_s=0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"body_timeout"' in answer


def test_a_trickling_body_gets_408(server: ServerProcess) -> None:
    """body_timeout_s bounds the whole body, not the pause between two bytes: a byte every
    0.2 s would keep a per-pause timeout of 1 s waiting until all 100 were in."""
    answer, sent = send_slowly(server, [HEAD] + [b" "] * 100, gap_s=0.2)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert sent < 1 + 100, "the server waited for the whole trickle"
    assert httpx.get(f"{server.url}/health").status_code == 200
