"""Chat templates rendered in a child process, bounded in time, memory and output size.

A model file's chat template is a program written by whoever made the file. Jinja's sandbox
keeps it away from Python's internals, but not from looping for hours, building a string of
gigabytes or recursing until the interpreter gives up, and the event loop that serves every
request must never wait on any of that. So templates render in one child process per
deployment (``python -m laya_core.template_sandbox``, started on first use, speaking JSON
lines over its stdin and stdout): it may take ``timeout_s`` per render (then it is killed and
restarted), its address space is capped at ``memory_bytes`` (a render that needs more fails;
the server's memory does not grow), its output stops at ``max_output_chars``, and anything it
raises, recursion included, is a :class:`TemplateError` for that request. Callers block
while the child renders: call :meth:`TemplateSandbox.render` from a worker thread.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

import attrs

from laya_core.chat_template import ChatTemplate, TemplateError, TemplateRefusal

# The child's own start costs about 22 MiB resident and 26 MiB of address space (Python,
# Jinja, Laya's template module), measured on x86-64 with CPython 3.11.
_CHILD_BASE_BYTES = 26 * 2**20


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
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.num_restarts = 0

    def render(self, source: str | None, bos_token: str, eos_token: str,
               messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None) -> str:
        job = {"source": source, "bos": bos_token, "eos": eos_token,
               "messages": [dict(m) for m in messages], "add_generation_prompt":
               add_generation_prompt, "tools": list(tools) if tools else None}
        line = (json.dumps(job) + "\n").encode()  # ASCII: every odd character escaped
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except OSError:
                self._kill()
                raise TemplateError("the chat template's renderer died") from None
            reply = self._read_reply(proc.stdout)
        status, value = reply["status"], reply["value"]
        if status == "refused":
            raise TemplateRefusal(value)
        if status == "error":
            raise TemplateError(value)
        return str(value)

    def _read_reply(self, out: IO[bytes]) -> dict[str, Any]:
        ready, _, _ = select.select([out], [], [], self.limits.timeout_s)
        if not ready:
            self._kill()
            raise TemplateError(f"the chat template ran longer than {self.limits.timeout_s:g} s")
        raw = out.readline()  # the child writes a whole line at once
        if not raw:
            self._kill()
            raise TemplateError("the chat template's renderer died")
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("alive", True):
            self._kill()  # it exits after a MemoryError: start a fresh one next time
        return reply

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "laya_core.template_sandbox",
                 str(self.limits.memory_bytes), str(self.limits.max_output_chars)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None
            self.num_restarts += 1

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill()


# -- the child ---------------------------------------------------------------------------------


def _render(template: ChatTemplate, job: dict[str, Any], max_chars: int) -> str:
    parts, size = [], 0
    for piece in template.generate(job["messages"], job["add_generation_prompt"],
                                   job.get("tools")):
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
    for line in sys.stdin.buffer:
        reply = _answer(json.loads(line), compiled, memory_bytes, max_chars)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if not reply.get("alive", True):
            return


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
