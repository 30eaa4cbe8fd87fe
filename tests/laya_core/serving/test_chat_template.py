import pytest

from laya_core.serving.chat_template import ChatTemplate, TemplateError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chatml_fallback_and_generation_prompt() -> None:
    text = ChatTemplate(None).render(MESSAGES)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_variables() -> None:
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                     "{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert t.render(MESSAGES) == "<s>hi</s>"


def test_untrusted_template_cannot_reach_python_internals() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate(evil).render(MESSAGES)


def test_template_cannot_mutate_the_messages() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render(MESSAGES)


def test_raise_exception_becomes_a_template_error() -> None:
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        t.render(MESSAGES)


def test_syntax_error_is_reported() -> None:
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
