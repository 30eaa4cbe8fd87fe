"""Chat templates rendered in a child process, bounded in time, memory and output size.

A model file's chat template is a program written by whoever made the file. Jinja's sandbox
keeps it away from Python's internals, but not from looping for hours, building a string of
gigabytes or recursing until the interpreter gives up, and the event loop that serves every
request must never wait on any of that. So templates render in one child process per
deployment (``python -m laya_core.serving.template_sandbox``, started on first use, speaking JSON
lines over its stdin and stdout): it may take ``timeout_s`` per render, writing the job and
reading the answer included (then it is killed and replaced), its address space is capped
at ``memory_bytes`` (a render that needs more fails; the server's memory does not grow),
its output stops at ``max_output_chars``, and anything it raises, recursion included, is a
:class:`TemplateError` for that request. Callers block while the child renders: call
:meth:`TemplateSandbox.render` from a worker thread.

The child is supervised. One that dies or stops answering through no fault of the template
(``kill -9``, ``SIGSTOP``) fails the render under way with :class:`TemplateUnavailableError`
(a 503 with Retry-After), and is replaced at once; one that dies while idle is replaced by
a watcher thread (after a backoff when children keep dying young), and a render that finds
it dead before sending anything runs on the new child. ``restarts``, ``up`` and
``status()`` feed ``/ready`` and ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import attrs

from laya_core.replica.child_exit import describe_exit
from laya_core.serving.chat_template import ChatTemplate, TemplateError, TemplateRefusal

log = logging.getLogger(__name__)
# The child's own start costs about 22 MiB resident and 26 MiB of address space (Python,
# Jinja, Laya's template module), measured on x86-64 with CPython 3.11.
_CHILD_BASE_BYTES = 26 * 2**20
# A child that dies on its own sooner than this after its start is replaced after a backoff
# (0.5 s, doubling to 30 s), so one that cannot start does not spin.
_STABLE_S = 10.0
# Signals a child raises itself when rendering crashes it (rather than being killed).
_CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE,
                      signal.SIGILL})


class TemplateUnavailableError(TemplateError):
    """The renderer died or stopped answering through no fault of the template; the
    request may be retried once it has been replaced (a 503 with Retry-After)."""


# How long a new child may take to start (the interpreter and jinja2's import) before its first
# render's own limit starts: seconds on a busy machine, never the template's fault.
START_TIMEOUT_S = 60.0


@attrs.frozen
class RenderLimits:
    """What one render may take; see the module docstring."""

    timeout_s: float = 2.0
    max_output_chars: int = 4 * 2**20
    memory_bytes: int = 64 * 2**20  # the child's whole address space (the memory plan counts it)

    def __attrs_post_init__(self) -> None:
        if self.memory_bytes <= _CHILD_BASE_BYTES:
            raise ValueError(f"memory_bytes must exceed the child's own {_CHILD_BASE_BYTES} B")


class TemplateSandbox:
    """The child process and the calls into it; one render at a time, from any thread."""

    def __init__(self, limits: RenderLimits | None = None) -> None:
        self.limits = limits or RenderLimits()
        self._lock = threading.Lock()  # one render at a time; guards _proc
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the child wrote its ready line
        self._started = 0.0  # time.monotonic() of the child's start
        self._young_deaths = 0  # children in a row that died on their own, young
        self._closed = False
        self.num_restarts = 0  # children replaced: died, killed, or past a bound
        self.last_exit: str | None = None  # why the last child was replaced

    @property
    def up(self) -> bool:
        """Whether a render can start now: the child runs, or is started by the render."""
        proc = self._proc
        return not self._closed and (proc is None or proc.poll() is None)

    def status(self) -> dict[str, Any]:
        """For /ready: up, the child's pid (None before its first use), restarts, why the
        last child went."""
        proc = self._proc
        return {"up": self.up, "pid": proc.pid if proc is not None else None,
                "restarts": self.num_restarts, "last_exit": self.last_exit}

    def render(self, source: str | None, bos_token: str, eos_token: str,
               messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        job = {"source": source, "bos": bos_token, "eos": eos_token,
               "messages": [dict(m) for m in messages], "add_generation_prompt":
               add_generation_prompt, "tools": list(tools) if tools else None,
               "variables": dict(variables or {})}
        line = (json.dumps(job) + "\n").encode()  # ASCII: every odd character escaped
        with self._lock:
            if self._closed:
                raise TemplateUnavailableError("the chat template's renderer has stopped")
            reply = self._exchange(line)
        status, value = reply["status"], reply["value"]
        if status == "refused":
            raise TemplateRefusal(value)
        if status == "error":
            raise TemplateError(value)
        return str(value)

    # -- one exchange, under the lock ---------------------------------------------------------

    def _exchange(self, line: bytes) -> dict[str, Any]:
        proc = self._child()
        if not self._ready:
            self._await_start(proc)
        deadline = time.monotonic() + self.limits.timeout_s
        if not self._write(proc, line, deadline):  # it died before taking the job
            proc = self._replace(proc, f"{_reaped(proc)} while idle")
            self._await_start(proc)
            deadline = time.monotonic() + self.limits.timeout_s
            if not self._write(proc, line, deadline):
                self._replace(proc, f"{_reaped(proc)} at its start")
                raise TemplateUnavailableError("the chat template's renderer died at its "
                                               "start; retry")
        raw = self._read(proc, deadline)
        if raw is None:
            self._time_out(proc)
        if not raw:
            self._died_rendering(proc)
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("alive", True):  # it exits after a MemoryError: start a fresh one
            self._replace(proc, "exited after running out of memory")
        return reply

    def _await_start(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for a new child's ready line, so that the interpreter's start (seconds on a
        busy machine) is not counted against the template's render limit."""
        raw = self._read(proc, time.monotonic() + START_TIMEOUT_S)
        if not raw:
            self._replace(proc, "stopped answering at its start" if raw is None
                          else f"{_reaped(proc)} at its start")
            raise TemplateUnavailableError("the chat template's renderer did not start; retry")
        self._ready = True

    def _write(self, proc: subprocess.Popen[bytes], data: bytes, deadline: float) -> bool:
        """Write the job, waiting for room until ``deadline``; False if the child is gone.
        The pipe is non-blocking: a stopped child, whose pipe is full, cannot hold us."""
        assert proc.stdin is not None
        fd, view = proc.stdin.fileno(), memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    self._time_out(proc)
            except OSError:  # EPIPE: nobody reads the pipe any more
                return False
        return True

    def _read(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        """The child's answer line; b"" if it died, None past the deadline."""
        assert proc.stdout is not None
        fd, parts = proc.stdout.fileno(), []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            parts.append(chunk)
            if chunk.endswith(b"\n"):  # the child writes one line per job, then waits
                return b"".join(parts)

    def _time_out(self, proc: subprocess.Popen[bytes]) -> NoReturn:
        """The render broke its time limit: the template's fault, unless the child was
        stopped (``SIGSTOP``) and so never ran it."""
        stopped = _is_stopped(proc.pid)
        self._replace(proc, "stopped answering" if stopped else
                      f"ran past the {self.limits.timeout_s:g} s limit")
        if stopped:
            raise TemplateUnavailableError("the chat template's renderer stopped answering "
                                           "and was replaced; retry")
        raise TemplateError(f"the chat template ran longer than {self.limits.timeout_s:g} s")

    def _died_rendering(self, proc: subprocess.Popen[bytes]) -> NoReturn:
        why = _reaped(proc)
        code = proc.returncode
        self._replace(proc, f"{why} while rendering")
        if code is not None and -code in _CRASHES:  # rendering crashed it
            raise TemplateError(f"the chat template crashed its renderer ({why})")
        raise TemplateUnavailableError(f"the chat template's renderer {why}; retry")

    # -- the child's life ---------------------------------------------------------------------

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            self._proc = self._spawn()
        return self._proc

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "laya_core.serving.template_sandbox",
             str(self.limits.memory_bytes), str(self.limits.max_output_chars)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            bufsize=0)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)
        self._ready = False  # until it writes its ready line
        self._started = time.monotonic()
        threading.Thread(target=self._watch, args=(proc,), daemon=True,
                         name="laya-template-sandbox-watch").start()
        return proc

    def _replace(self, proc: subprocess.Popen[bytes], why: str) -> subprocess.Popen[bytes]:
        """Kill ``proc`` (if it still runs) and start the next child; under the lock, open."""
        _end(proc)
        self.num_restarts += 1
        self.last_exit = why
        log.warning("the chat-template sandbox's child %d %s; replaced", proc.pid, why)
        self._proc = self._spawn()
        return self._proc

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Replace the child when it dies while no render holds it (a render that holds it
        replaces it itself)."""
        proc.wait()
        with self._lock:
            if self._proc is not proc or self._closed:
                return  # replaced or closed already
            young = time.monotonic() - self._started < _STABLE_S
            self._young_deaths = self._young_deaths + 1 if young else 0
            wait = min(30.0, 0.5 * 2 ** (self._young_deaths - 2)) if self._young_deaths > 1 \
                else 0.0
            if not wait:
                self._replace(proc, f"{_exit_of(proc)} while idle")
                return
        time.sleep(wait)  # meanwhile a render replaces it, finding it dead
        with self._lock:
            if self._proc is proc and not self._closed:
                self._replace(proc, f"{_exit_of(proc)} while idle")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._proc is not None:
                _end(self._proc)
                self._proc = None


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and close its pipes; raw pipes, so closing flushes nothing."""
    if proc.poll() is None:
        proc.kill()  # SIGKILL ends a stopped process too
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _reaped(proc: subprocess.Popen[bytes]) -> str:
    """How a child that closed its pipes ended, once it has (up to 5 s)."""
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    return _exit_of(proc)


def _exit_of(proc: subprocess.Popen[bytes]) -> str:
    return describe_exit(proc.poll(), "stopped answering")


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (``SIGSTOP``, a tracer), from Linux's /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


# -- the child ---------------------------------------------------------------------------------


def _render(template: ChatTemplate, job: dict[str, Any], max_chars: int) -> str:
    parts, size = [], 0
    for piece in template.generate(job["messages"], job["add_generation_prompt"],
                                   job.get("tools"), job.get("variables")):
        size += len(piece)
        if size > max_chars:
            raise TemplateError(f"the chat template's output passed {max_chars} characters")
        parts.append(piece)
    text = "".join(parts)
    text.encode("utf-8")  # lone surrogates and the like: not text a tokenizer takes
    return text


def _answer(job: dict[str, Any], compiled: dict[tuple[Any, ...], ChatTemplate],
            memory_bytes: int, max_chars: int) -> dict[str, Any]:
    try:
        key = (job["source"], job["bos"], job["eos"])
        template = compiled.get(key) or ChatTemplate(*key)
        compiled[key] = template
        return {"status": "ok", "value": _render(template, job, max_chars)}
    except MemoryError:
        # A failed allocation can leave the interpreter short: say so, and start afresh.
        return {"status": "error", "alive": False, "value": f"the chat template needed more "
                f"than its {memory_bytes // 2**20} MiB of memory"}
    except TemplateRefusal as e:
        return {"status": "refused", "value": str(e)}
    except RecursionError:
        return {"status": "error", "value": "the chat template recursed too deeply"}
    except UnicodeEncodeError:
        return {"status": "error", "value": "the chat template produced text that is not "
                "valid Unicode (a lone surrogate)"}
    except Exception as e:  # noqa: BLE001 - any failure of untrusted code is the template's
        return {"status": "error", "value": str(e) if isinstance(e, TemplateError)
                else f"the chat template failed: {type(e).__name__}: {e}"}


def _child_main(memory_bytes: int, max_chars: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    compiled: dict[tuple[Any, ...], ChatTemplate] = {}
    sys.stdout.write('{"status": "ready"}\n')  # imports done: renders may start
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        reply = _answer(json.loads(line), compiled, memory_bytes, max_chars)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if not reply.get("alive", True):
            return


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
