"""A ``laya serve`` process for one model, as a user starts it: a manifest file, a loopback
port, the log in a file; stopped (with its worker processes) however the stage ends.

The server runs in a process group of its own, so that stopping it reaches its workers, and
its id is written to ``$GPU_CHECK_WORK/pids/`` for tools/gpu_check.sh to end it should this
stage itself be killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Self

import common


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def manifest_text(model: dict[str, Any], budget: str | None = None, port: int = 0) -> str:
    """One model's manifest: ``model`` is its ``[[models]]`` entry (``options`` a table)."""
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "shutdown_timeout_s = 3",
             "access_log = false"]
    if budget:
        lines += ["[memory]", f"budget = {toml_value(budget)}"]
    lines.append("[[models]]")
    lines += [f"{k} = {toml_value(v)}" for k, v in model.items() if k != "options"]
    lines.append("[models.options]")
    lines += [f"{k} = {toml_value(v)}" for k, v in model.get("options", {}).items()]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LayaServer:
    """``with LayaServer(name, model) as server:`` serves ``model`` at ``server.url`` once
    ready; ``ready_s`` is how long the start took."""

    def __init__(self, name: str, model: dict[str, Any], *, budget: str | None = None,
                 ready_timeout_s: float = 240.0) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work = common.work_dir()
        self.manifest = work / f"{name}.toml"
        self.manifest.write_text(manifest_text(model, budget, self.port))
        self.log_path = work / "logs" / f"server-{name}.log"
        self.pid_path = work / "pids" / f"server-{name}.pid"
        self.ready_timeout_s = ready_timeout_s
        self.ready_s = 0.0
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "laya_core.cli.main", "serve", str(self.manifest)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_path.write_text(str(self.process.pid))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - start
        common.log(f"{self.name}: ready at {self.url} in {self.ready_s:.1f} s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        import httpx

        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise common.StageFailed(f"laya serve ({self.name}) exited with "
                                         f"{self.process.returncode} before it was ready: "
                                         f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise common.StageFailed(f"laya serve ({self.name}) was not ready after "
                                 f"{self.ready_timeout_s:.0f} s: {self.log_tail()}")

    def status(self) -> dict[str, Any]:
        """GET /ready's body (replicas, memory plan)."""
        import httpx

        return dict(httpx.get(self.url + "/ready", timeout=10).json())

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's group (it drains for shutdown_timeout_s), then SIGKILL."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers of the group that outlived the server (it waits for them, but be sure).
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.pid_path.unlink(missing_ok=True)

