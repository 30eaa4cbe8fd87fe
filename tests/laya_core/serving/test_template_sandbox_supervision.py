"""The chat-template sandbox's child is supervised: killed (``kill -9``) or stopped
(``SIGSTOP``), idle or in the middle of a render, it is replaced; the render under way fails
with TemplateUnavailableError (the HTTP side's 503 with Retry-After) and the next renders.
Before, a killed child left every later render failing (BrokenPipeError, then ValueError),
and a stopped one held a render writing a long job for ever."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from laya_core.serving.chat_template import TemplateError
from laya_core.serving.template_sandbox import (
    RenderLimits,
    TemplateSandbox,
    TemplateUnavailableError,
)

HI = [{"role": "user", "content": "hi"}]
CHATML_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
LOOP_FOREVER = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")


def started(limits: RenderLimits) -> tuple[TemplateSandbox, int]:
    """A sandbox whose child has rendered once, and that child's pid."""
    box = TemplateSandbox(limits)
    assert box.render(None, "", "", HI) == CHATML_HI
    pid = box.status()["pid"]
    assert isinstance(pid, int) and box.up
    return box, pid


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll until true; the timeout only gives up waiting."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def in_thread(render: Callable[[], str]) -> Callable[[], BaseException | str]:
    """Run ``render`` on a thread; the returned call waits for its result or error."""
    out: list[BaseException | str] = []

    def run() -> None:
        try:
            out.append(render())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()

    def result() -> BaseException | str:
        thread.join(120)  # gives up waiting only: a render that hangs fails the test
        assert not thread.is_alive(), "the render never returned"
        return out[0]

    return result


def test_a_child_killed_while_idle_is_replaced_at_once() -> None:
    box, pid = started(RenderLimits())
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: box.status()["pid"] != pid)  # the watcher, with no render asking
        status = box.status()
        assert status["restarts"] == 1 and status["up"] and psutil.pid_exists(status["pid"])
        assert status["last_exit"] == "was killed by SIGKILL while idle"
        assert box.render(None, "", "", HI) == CHATML_HI
        assert box.num_restarts == 1
    finally:
        box.close()


def test_a_child_killed_mid_render_fails_that_render_with_a_retry() -> None:
    # A limit far beyond the test: the kill, not the limit, ends the render.
    box, pid = started(RenderLimits(timeout_s=600))
    try:
        child = psutil.Process(pid)
        cpu = sum(child.cpu_times()[:2])
        result = in_thread(lambda: box.render(LOOP_FOREVER, "", "", HI))
        wait_for(lambda: sum(child.cpu_times()[:2]) > cpu + 0.3)  # it is rendering
        os.kill(pid, signal.SIGKILL)
        error = result()
        assert isinstance(error, TemplateUnavailableError), error
        assert "killed by SIGKILL; retry" in str(error)
        assert box.render(None, "", "", HI) == CHATML_HI
        status = box.status()
        assert status["restarts"] == 1 and status["pid"] != pid
        assert status["last_exit"] == "was killed by SIGKILL while rendering"
    finally:
        box.close()


@pytest.mark.parametrize("content", ["hi", "x" * 2**20], ids=["short", "longer than a pipe"])
def test_a_stopped_child_fails_the_render_within_its_limit_and_is_replaced(
        stopped: list[int], content: str) -> None:
    """A short job waits for an answer, a long one for room in the pipe: both end at the
    time limit, as a 503 (the child never ran the template) rather than the template's 400."""
    box, pid = started(RenderLimits(timeout_s=1.0))
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        messages = [{"role": "user", "content": content}]
        error = in_thread(lambda: box.render(None, "", "", messages))()
        assert isinstance(error, TemplateUnavailableError), error
        assert "stopped answering" in str(error)
        assert not psutil.pid_exists(pid)  # killed and reaped
        status = box.status()
        assert status["restarts"] == 1 and status["last_exit"] == "stopped answering"
        assert box.render(None, "", "", messages).startswith("<|im_start|>user\n" + content)
    finally:
        box.close()


def test_a_slow_template_is_still_the_templates_fault() -> None:
    box, _ = started(RenderLimits(timeout_s=1.0))
    try:
        with pytest.raises(TemplateError, match="longer than 1 s") as e:
            box.render(LOOP_FOREVER, "", "", HI)
        assert not isinstance(e.value, TemplateUnavailableError)
        assert box.status()["last_exit"] == "ran past the 1 s limit"
    finally:
        box.close()


def test_a_closed_sandbox_renders_nothing() -> None:
    box, pid = started(RenderLimits())
    box.close()
    assert not box.up and not psutil.pid_exists(pid)
    with pytest.raises(TemplateUnavailableError):
        box.render(None, "", "", HI)


def test_a_slow_start_of_the_child_is_not_counted_against_the_render(
        stopped: list[int]) -> None:
    """On a busy machine the interpreter's start can take longer than a render may: the
    render's limit starts once the child says it is ready. Here the new child is held
    (SIGSTOP) for longer than the limit before it may start."""
    sandbox = TemplateSandbox(RenderLimits(timeout_s=0.5))
    try:
        pid = sandbox._child().pid
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        release = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
        release.start()
        assert sandbox.render(None, "", "", HI) == CHATML_HI
        assert sandbox.num_restarts == 0
        release.join()
    finally:
        sandbox.close()
