"""Logging for every process of a server (the ``laya`` command, its workers, its Ray actors):
one handler on the root logger, so each line prints once.

Hypercorn would give its ``hypercorn.error`` logger a stderr handler of its own that also
propagates to the root, which printed its "Running on" line twice; ``serve.hypercorn_config``
hands it the plain logger instead, so its lines reach this handler alone.
"""

from __future__ import annotations

import logging
import os
import sys

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
