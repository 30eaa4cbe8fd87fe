"""Hostile chat templates fail their request, within bounds; the server's process is untouched.

Each template here was sent to a live server by a red-team pass: before the sandbox they
stopped the event loop, grew the server by gigabytes, or answered 500.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest

from laya_core.serving.chat_template import TemplateError, TemplateRefusal
from laya_core.serving.template_sandbox import RenderLimits, TemplateSandbox

HI = [{"role": "user", "content": "hi"}]
HOSTILE = {
    "nested loops of 10^10 turns": ("{% for i in range(100000) %}{% for j in range(100000) %}"
                                    "{% endfor %}{% endfor %}", "longer than 1 s"),
    "a 50 MB string": ("{{ 'a' * 50000000 }}", "more than its 64 MiB"),
    "a 100 MB format width": ("{{ '%100000000s'|format('a') }}", "more than its 64 MiB"),
    "an include": ("{% include '/etc/passwd' %}", "no loader"),
    "a recursive macro": ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
                          "recursed too deeply"),
    "a 5000-digit number": ("{{ (10**5000)|string }}", "integer string conversion"),
    "a lone surrogate": ("{{ '\\ud800' }}", "not valid Unicode"),
    "too much output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
                        "passed 4194304 characters"),
}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[TemplateSandbox]:
    box = TemplateSandbox(RenderLimits(timeout_s=1.0))
    yield box
    box.close()


def test_a_plain_template_renders(sandbox: TemplateSandbox) -> None:
    text = sandbox.render(None, "", "", HI)  # ChatML, the default
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    source = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert sandbox.render(source, "<s>", "</s>", HI, add_generation_prompt=False) == "<s>[user]hi"


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_template_fails_within_bounds(sandbox: TemplateSandbox, case: str) -> None:
    source, said = HOSTILE[case]
    rss_before = psutil.Process().memory_info().rss
    with pytest.raises(TemplateError, match=said):  # the limit's own message
        sandbox.render(source, "", "", HI)
    assert psutil.Process().memory_info().rss - rss_before < 16 * 2**20
    # The sandbox goes on serving well-behaved templates.
    assert sandbox.render(None, "", "", HI).startswith("<|im_start|>user")


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}",
                                    "{{ cycler.__init__.__globals__.os.popen('id').read() }}"])
def test_the_sandbox_keeps_jinjas_sandbox(sandbox: TemplateSandbox, source: str) -> None:
    with pytest.raises(TemplateError, match="unsafe|undefined"):
        sandbox.render(source, "", "", HI)


def test_raise_exception_is_a_refusal(sandbox: TemplateSandbox) -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(TemplateRefusal, match="system first"):
        sandbox.render(source, "", "", HI)


def test_limits_must_leave_room_for_the_child() -> None:
    with pytest.raises(ValueError, match="memory_bytes"):
        RenderLimits(memory_bytes=2**20)
