"""How a child process of the server ended, in words for logs, /ready and error messages."""

from __future__ import annotations

import signal


def describe_exit(code: int | None, running: str) -> str:
    """``code`` as ``Popen.returncode`` gives it (negative: the signal that ended it);
    ``running``: what to say while there is no code yet."""
    if code is None:
        return running
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
