"""llama.cpp's log: errors to stderr, the rest dropped or, while loading, read for facts.

llama.cpp reports where it put each model's weights only in its log ("CPU_REPACK model
buffer size = 56.95 MiB"), so the backend captures the log around ``llama_model_load_from_file``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

_GGML_LOG_LEVEL_ERROR = 4
_GGML_LOG_LEVEL_CONT = 5  # the rest of the previous message
_BUFFER_LINE = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")


class LlamaLog:
    """llama.cpp's log: errors go to stderr; the rest is dropped, except while ``capture``
    collects it (the weights' buffer types are only reported there)."""

    def __init__(self) -> None:
        self.lines: list[str] | None = None
        self._capturing = threading.Lock()
        self.callback: Any = None  # kept alive: llama.cpp holds a raw pointer to it

    def install(self, ll: Any) -> None:
        if self.callback is not None:
            return

        @ll.llama_log_callback
        def callback(level: int, text: bytes, user_data: Any) -> None:
            if level == _GGML_LOG_LEVEL_ERROR:
                os.write(2, text)
            lines = self.lines
            if lines is not None:
                piece = text.decode("utf-8", "replace")
                if level == _GGML_LOG_LEVEL_CONT and lines:
                    lines[-1] += piece
                else:
                    lines.append(piece)

        self.callback = callback
        ll.llama_log_set(callback, ctypes.c_void_p(0))

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Collect the log while the block runs; one capture at a time (replicas that load
        together take turns, so each reads its own model's lines)."""
        with self._capturing:
            lines: list[str] = []
            self.lines = lines
            try:
                yield lines
            finally:
                self.lines = None


LLAMA_LOG = LlamaLog()  # one per process: llama.cpp has one log callback


def weight_buffers(log_lines: list[str]) -> dict[str, int]:
    """Bytes of weights in each llama.cpp buffer type, from its load log."""
    found: dict[str, int] = {}
    for m in _BUFFER_LINE.finditer("".join(log_lines)):
        found[m.group(1)] = found.get(m.group(1), 0) + round(float(m.group(2)) * 2**20)
    return found
