"""Constraints tried out in a child process first, bounded in time, memory and stack.

llguidance compiles a grammar in native code that recurses with the grammar's depth: a
``$ref`` chain of 5,000 or a chain of 5,000 Lark rules overflows the stack and kills the
process (SIGSEGV), and some grammars take seconds and hundreds of MiB for one mask. So a
constraint is first compiled in one child process per replica (``python -m
laya_core.structured.sandbox``, started on first use, JSON lines over its stdin and
stdout), which also converts GBNF to Lark (quadratic in the rules) and runs its first
masks along a short walk of allowed tokens. What the child survives within the limits
(:class:`CompileLimits`) the replica compiles again for itself, knowing that it ends; what
kills the child, outruns ``timeout_s`` (then it is killed) or needs more than
``memory_bytes`` costs that one request a 400, and the next check starts a fresh child.

The child compiles on a thread with a ``stack_bytes`` stack (4 MiB), the replica on one of
four times that (:mod:`laya_core.structured.compiler`): the same grammar recurses as deep in
both. It answers with the grammar to compile (converted, for GBNF), the bytes the matcher
holds after the walk (glibc's count of allocated bytes, before and after), and the slowest
mask of the walk after the first, in the thread's CPU time (a busy machine makes the niced
child wait, not the grammar cost more). Callers block while it works: call :meth:`check`
from a worker thread.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from typing import IO, Any

import attrs

_START_TIMEOUT_S = 60.0  # the child's start: Python, llguidance, the vocabulary's index


@attrs.frozen
class CompileLimits:
    """What compiling one constraint, and each step of generating under it, may take.

    The llguidance limits (``initial_lexer_fuel`` ... ``max_items_in_row``) bound the
    matcher's work for the whole constraint and for each mask, at every step of every
    request (its ``ParserLimits``); the others bound the check in the child.
    """

    timeout_s: float = 5.0  # converting, compiling and the walk's masks
    memory_bytes: int = 48 * 2**20  # address space one check may add to the child
    max_grammar_bytes: int = 16 * 2**20  # what the matcher may hold after the walk
    max_mask_s: float = 0.05  # the walk's slowest mask after the first, in CPU time
    first_masks: int = 8
    stack_bytes: int = 4 * 2**20
    nice: int = 10  # added to the child's and the compile thread's: generation goes first
    # llguidance's ParserLimits, below its defaults (1M, 200k, 50k, 250k, 500k, 2000):
    # about 10 ms of lexer construction, 7 ms of lexer and 1 ms of parser work per mask,
    # and at most 3 MiB of lexer states a grammar (measured 640 B a state).
    initial_lexer_fuel: int = 500_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 20_000
    max_lexer_states: int = 5_000
    max_grammar_size: int = 200_000
    max_items_in_row: int = 2_000

    def parser_limits(self) -> dict[str, Any]:
        """The keyword arguments of ``llguidance.LLParserLimits``."""
        return {"initial_lexer_fuel": self.initial_lexer_fuel,
                "step_lexer_fuel": self.step_lexer_fuel, "step_max_items": self.step_max_items,
                "max_lexer_states": self.max_lexer_states,
                "max_grammar_size": self.max_grammar_size,
                "max_items_in_row": self.max_items_in_row}


@attrs.frozen
class Vocabulary:
    """What llguidance needs of a tokenizer, as plain data for the child."""

    tokens: Sequence[bytes]
    special_token_ids: Sequence[int]
    eos_token_ids: Sequence[int]


@attrs.frozen
class Checked:
    """A constraint the child compiled and walked: the grammar text to compile (GBNF
    converted to Lark), what its matcher held after the walk, and its slowest step."""

    grammar: str
    num_bytes: int
    mask_s: float


class Refused(Exception):
    """Why a constraint cannot be used, without the field it came from (the cache keeps
    it for every request that sends the same text); see :func:`laya_core.structured.
    compiler.explain`. ``matcher`` is whether llguidance's own message says why."""

    def __init__(self, reason: str, matcher: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.matcher = matcher


class CompileSandbox:
    """The child process and the calls into it; one check at a time, from any thread."""

    def __init__(self, vocabulary: Vocabulary, limits: CompileLimits | None = None) -> None:
        self.limits = limits or CompileLimits()
        self._vocabulary = vocabulary
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self.num_restarts = 0

    def check(self, grammar: str, convert: bool) -> Checked:
        """Compile ``grammar`` (llguidance's text; with ``convert`` a client's Lark or GBNF
        grammar) in the child; raises :class:`Refused`."""
        line = (json.dumps({"grammar": grammar, "convert": convert}) + "\n").encode()
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except OSError:
                raise self._died() from None
            reply = self._read(proc.stdout, self.limits.timeout_s, "compiling it took longer "
                               f"than {self.limits.timeout_s:g} s")
        if reply["status"] != "ok":
            raise Refused(reply["value"], matcher=reply["status"] == "matcher")
        return Checked(reply["grammar"], int(reply["bytes"]), float(reply["mask_s"]))

    def _read(self, out: IO[bytes], timeout_s: float, too_slow: str) -> dict[str, Any]:
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready:
            self._kill()
            raise Refused(too_slow)
        raw = out.readline()  # the child writes a whole line at once
        if not raw:
            raise self._died()
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("alive", True):
            self._kill()  # it exits after a MemoryError: start a fresh one next time
        return reply

    def _died(self) -> Refused:
        """The child ended mid-check: what it wrote last says whether memory ran out."""
        assert self._stderr is not None
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(self._stderr.tell() - 4096, 0))
        said = self._stderr.read().decode("utf-8", "replace")
        self._kill()
        if "memory allocation" in said or "MemoryError" in said:
            return Refused(f"compiling it needed more than the "
                           f"{self.limits.memory_bytes // 2**20} MiB of memory one constraint "
                           "may use")
        return Refused("it crashed the compiler (a grammar or schema nested or chained too "
                       "deeply does this)")

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            self._stderr = tempfile.TemporaryFile()
            # One malloc arena: a second thread's would reserve 64 MiB of the address space
            # the child is capped to.
            env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "laya_core.structured.sandbox"], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
            assert self._proc.stdin is not None and self._proc.stdout is not None
            # A compiler nobody closed ends its child when it is collected, or at exit.
            self._finalizer = weakref.finalize(self, _end, self._proc, self._stderr)
            try:
                self._proc.stdin.write(self._setup())
                self._proc.stdin.flush()
            except OSError:
                raise self._died() from None
            self._read(self._proc.stdout, _START_TIMEOUT_S, "the constraint compiler did not "
                       f"start within {_START_TIMEOUT_S:g} s")
        return self._proc

    def _setup(self) -> bytes:
        v, limits = self._vocabulary, self.limits
        return (json.dumps({
            "tokens": [t.hex() for t in v.tokens], "specials": list(v.special_token_ids),
            "eos": list(v.eos_token_ids), "parser_limits": limits.parser_limits(),
            "memory_bytes": limits.memory_bytes, "first_masks": limits.first_masks,
            "stack_bytes": limits.stack_bytes, "nice": limits.nice}) + "\n").encode()

    def _kill(self) -> None:
        if self._proc is not None:
            assert self._finalizer is not None
            self._finalizer()
            self._proc = None
            self.num_restarts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill()


def _end(proc: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
    proc.kill()
    proc.wait(5)
    for pipe in (proc.stdin, proc.stdout, stderr):
        if pipe is not None:
            pipe.close()


if __name__ == "__main__":
    # Ignore the terminal's Ctrl-C and a service manager's SIGTERM to the process group:
    # the replica decides when this child ends, by closing its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from laya_core.structured import sandbox_child

    sandbox_child.main()
