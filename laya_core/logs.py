"""Logging for every process of a server (the ``laya`` command, its workers, its Ray actors):
one handler on the root logger, so each line prints once. And what the operating system shows
of a process: its resident memory, and its threads' names (:func:`start_named`).

Hypercorn would give its ``hypercorn.error`` logger a stderr handler of its own that also
propagates to the root, which printed its "Running on" line twice; ``serve.hypercorn_config``
hands it the plain logger instead, so its lines reach this handler alone.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

FORMAT = "laya: %(levelname)s %(name)s: %(message)s"


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler setup_logging installs; a second call replaces it."""


def setup_logging(level: int = logging.INFO) -> None:
    """Send every logger's lines to stderr, once each, as ``laya: LEVEL logger: message``."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(level)


def resident_bytes(pid: int | None = None) -> int | None:
    """The resident set size now of this process (or of ``pid``), from Linux's /proc; None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def start_named(thread: threading.Thread, os_name: str) -> threading.Thread:
    """Start ``thread`` under ``os_name`` (15 characters at most) where the operating system
    names threads, so that ``top -H``, ``ps -L``, py-spy and ``tools/overhead_per_token.py``
    tell Laya's threads apart (Python's own names stay inside the interpreter). Linux only;
    elsewhere, or when the thread has ended already, the thread just runs. A thread that runs
    already (the main one) is only named."""
    if thread.ident is None:
        thread.start()
    if sys.platform.startswith("linux") and thread.native_id is not None:
        try:  # a process may rename any of its own threads
            with open(f"/proc/self/task/{thread.native_id}/comm", "w") as comm:
                comm.write(os_name[:15])
        except OSError:
            pass
    return thread
