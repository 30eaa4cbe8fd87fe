"""The tool-call formats of the main families (laya_core/structured/tool_formats.py): each
parser on fixture texts, whole and streamed at every split point; each grammar against its
family's calls and malformed ones; detection from chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from toy_backend import END, ToyTokenizer

from laya_core.backend import ModelInfo
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.spec import ConstraintSpec, GrammarError
from laya_core.structured.tool_formats import FORMATS, detect, tool_format
from laya_core.structured.tools import Tool, ToolUse, call_grammar

TOY_INFO = ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                     chat_template=None, bos_token="", eos_token="", add_bos=False)
WEATHER = Tool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False})
TIME = Tool("get_time", None, {"type": "object", "properties": {}})
USE = ToolUse((WEATHER, TIME))

# Per family: a reply (text, then two calls), the content and the calls it holds.
PARIS = '{"city": "Paris"}'
TOKYO = '{"city": "Tokyo", "days": 3}'
SAMPLES: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               f'{PARIS}}}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": '
               '{}}\n</tool_call>', "Let me look.\n",
               [("get_weather", PARIS), ("get_time", "{}")]),
    "llama3_json": (f'{{"name": "get_weather", "parameters": {PARIS}}}; '
                    f'{{"name": "get_weather", "parameters": {TOKYO}}}', "",
                    [("get_weather", PARIS), ("get_weather", TOKYO)]),
    "mistral": (f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, '
                '{"name": "get_time", "arguments": {}}]', "Sure.",
                [("get_weather", PARIS), ("get_time", "{}")]),
    "mistral_args": (f"Sure.[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]get_time"
                     "[ARGS]{}", "Sure.", [("get_weather", PARIS), ("get_time", "{}")]),
    "qwen3_coder": ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "Tokyo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
                    "</tool_call>", "I will check.\n",
                    [("get_weather", TOKYO), ("get_time", "{}")]),
    "harmony": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                f"{PARIS}<|call|>", "<|channel|>analysis<|message|>Need the weather.<|end|>",
                [("get_weather", PARIS)]),
}


def parse(family: str, pieces: list[str], answer: bool = False,
          ) -> tuple[str, list[tuple[str, str]], bool]:
    """Content, calls and completeness from streamed pieces, deltas joined."""
    parser = FORMATS[family].parser(USE, answer)
    content, calls = "", {}  # index -> [name, arguments]
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    for kind, value in deltas:
        if kind == "content":
            content += value
            continue
        if "id" in value:
            assert value["index"] not in calls and value["function"]["arguments"] == ""
            calls[value["index"]] = [value["function"]["name"], ""]
        calls[value["index"]][1] += value["function"]["arguments"]
    joined = [(n, a) for n, a in calls.values()]
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    assert joined == whole
    return content, whole, parser.complete


@pytest.mark.parametrize("family", SAMPLES)
def test_each_parser_reads_its_family_whole_and_at_every_split(family: str) -> None:
    text, content, calls = SAMPLES[family]
    assert parse(family, [text]) == (content, calls, True)
    for i in range(len(text) + 1):
        assert parse(family, [text[:i], text[i:]]) == (content, calls, True), i
    assert parse(family, list(text)) == (content, calls, True)  # a character at a time
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("family", SAMPLES)
def test_a_cut_reply_streams_as_it_reads_whole(family: str) -> None:
    """At every cut: the streamed deltas equal the whole reading; a call cut inside its
    name is text, exactly as generated, and a call after that is as far as it got."""
    text = SAMPLES[family][0]
    for cut in range(len(text)):
        short = text[:cut]
        whole = parse(family, [short])
        assert parse(family, list(short)) == whole, cut
        content, calls, complete = whole
        if not calls:  # nothing lost, nothing added
            assert content == short, cut
        else:  # the calls as far as they got, each the sample's
            assert content.startswith(SAMPLES[family][1]), cut
            for (name, arguments), (want, whole_args) in zip(calls, SAMPLES[family][2], strict=False):
                assert name == want and whole_args.startswith(arguments), cut


def test_text_that_only_begins_a_trigger_is_content_in_the_end() -> None:
    assert parse("mistral", ["It costs [TOOL"]) == ("It costs [TOOL", [], True)
    assert parse("harmony", ["<|channel|>final<|message|>Hi"]) == \
        ("<|channel|>final<|message|>Hi", [], True)
    assert parse("qwen3_coder", ["a <tool_call>\n<function=get_w"]) == \
        ("a <tool_call>\n<function=get_w", [], True)


def test_llama3_json_calls_at_the_start_or_after_python_tag_only() -> None:
    call = f'{{"name": "get_weather", "parameters": {PARIS}}}'
    assert parse("llama3_json", ["Say {x}."]) == ("Say {x}.", [], True)
    assert parse("llama3_json", ["Ok. <|python_tag|>" + call]) == \
        ("Ok. ", [("get_weather", PARIS)], True)
    assert parse("llama3_json", ["\n " + call]) == ("", [("get_weather", PARIS)], True)
    # Beside a typed answer, a reply's leading JSON is the answer, not a call.
    answer = '{"name": "Paris", "population": 2100000}'
    assert parse("llama3_json", [answer], answer=True) == (answer, [], True)


def test_qwen3_coder_types_values_by_the_tool_schema() -> None:
    tool = Tool("f", None, {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "x": {}}})
    parser = FORMATS["qwen3_coder"].parser(ToolUse((tool,)))
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (
        ("s", "12"), ("n", "1.5"), ("b", "true"), ("o", '{"a": [1]}'), ("x", "free text")))
    parser.feed(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
    parser.finish()
    (call,) = parser.calls
    assert json.loads(call["function"]["arguments"]) == \
        {"s": "12", "n": 1.5, "b": True, "o": {"a": [1]}, "x": "free text"}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ToyTokenizer(), TOY_INFO)


def allowed(compiler: GrammarCompiler, spec: ConstraintSpec, text: str) -> set[str]:
    mask = compiler.constraint(spec)(list(text.encode()))
    return {"END" if t == END else chr(t) for t in mask.token_ids()}


def accepts(compiler: GrammarCompiler, spec: ConstraintSpec, text: str) -> bool:
    return all(text[i] in allowed(compiler, spec, text[:i]) for i in range(len(text))) \
        and "END" in allowed(compiler, spec, text)


# Per family: one call as its grammar writes it, and malformed calls it must refuse.
CALLS: dict[str, tuple[str, list[str]]] = {
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [
        '{"name": "get_weather", "parameters": {"town": "Paris"}}',
        '{"name": "get_rain", "parameters": {"city": "Paris"}}']),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', [
        '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 3}}]']),
    "mistral_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [
        '[TOOL_CALLS]get_weather{"city": "Paris"}',
        '[TOOL_CALLS]get_weather[ARGS]{"days": 3}']),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>", [
                        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
                        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                        "</parameter>\n<parameter=days>\nthree\n</parameter>\n"
                        "</function>\n</tool_call>"]),
    "harmony": ("<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}<|call|>', [
                    "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                    '<|message|>{"city": "Paris"}',
                    '<|channel|>final<|message|>{"city": "Paris"}<|call|>']),
}


@pytest.mark.parametrize("family", CALLS)
def test_each_grammar_takes_its_calls_and_refuses_malformed_ones(
        compiler: GrammarCompiler, family: str) -> None:
    call, bad = CALLS[family]
    fmt = FORMATS[family]
    for choice in ("required", "get_weather"):
        spec = call_grammar(ToolUse((WEATHER,), choice), fmt=fmt)
        assert accepts(compiler, spec, call)
        assert not accepts(compiler, spec, "Sure. " + call)  # a forced call: nothing first
        for text in bad:
            assert not accepts(compiler, spec, text), text
    auto = call_grammar(ToolUse((WEATHER,)), fmt=fmt)
    assert accepts(compiler, auto, "No call needed.")
    trigger = "<|python_tag|>" if family == "llama3_json" else ""
    assert accepts(compiler, auto, "Let me see. " + trigger + call)  # free text, then a call
    for text in bad:
        if text.startswith(fmt.trigger):  # constrained from its trigger on
            assert not accepts(compiler, auto, "Let me see. " + text), text


def test_parallel_calls_follow_each_family_separator(compiler: GrammarCompiler) -> None:
    for family in SAMPLES:
        if family in ("harmony", "hermes"):
            continue
        text = SAMPLES[family][0].removeprefix(SAMPLES[family][1])
        spec = call_grammar(ToolUse((WEATHER, TIME), "required"), fmt=FORMATS[family])
        assert accepts(compiler, spec, text), family
        single = call_grammar(ToolUse((WEATHER, TIME), "required", parallel=False),
                              fmt=FORMATS[family])
        assert not accepts(compiler, single, text), family
    # gpt-oss ends its turn at a call: one call a reply.
    spec = call_grammar(ToolUse((WEATHER,), "required"), fmt=FORMATS["harmony"])
    assert allowed(compiler, spec, CALLS["harmony"][0]) == {"END"}


def test_the_grammars_parse_back_to_the_same_calls(compiler: GrammarCompiler) -> None:
    for family, (call, _) in CALLS.items():
        _, calls, complete = parse(family, [call])
        assert complete and [name for name, _ in calls] == ["get_weather"], family
        assert json.loads(calls[0][1])["city"] == "Paris"


def test_llama3_json_beside_a_typed_answer_calls_after_python_tag(
        compiler: GrammarCompiler) -> None:
    from laya_core.structured import formats

    answer = formats.json_schema({"type": "object", "properties": {"name": {
        "type": "string"}}, "required": ["name"]}, "response_format")
    spec = call_grammar(USE, answer=answer, fmt=FORMATS["llama3_json"])
    assert accepts(compiler, spec, '{"name": "Paris"}')
    assert accepts(compiler, spec, "<|python_tag|>" + CALLS["llama3_json"][0])
    assert not accepts(compiler, spec, "Hi " + CALLS["llama3_json"][0])


def test_a_qwen3_coder_string_with_a_pattern_is_refused() -> None:
    tool = Tool("f", None, {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^a+$"}}})
    with pytest.raises(GrammarError, match="pattern"):
        call_grammar(ToolUse((tool,), "required"), fmt=FORMATS["qwen3_coder"])


TEMPLATE_MARKERS = {
    "hermes": "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>",
    "llama3_json": "{% if tools %}<|python_tag|>{% endif %}",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS][",
    "mistral_args": "{% if tools %}{% endif %}[TOOL_CALLS]{{ name }}[ARGS]",
    "qwen3_coder": "{% if tools %}<tool_call>\n<function={{ n }}>\n<parameter={{ p }}>",
    "harmony": "{% if tools %}<|start|>assistant to=functions.{{ n }}<|channel|>{% endif %}"
               "<|call|>",
}


def test_the_family_is_detected_from_the_chat_template_and_overridable() -> None:
    for family, template in TEMPLATE_MARKERS.items():
        assert detect(template) == family
        assert tool_format(template).name == family
        assert tool_format(template, "auto").name == family
    assert detect(None) == "hermes"
    assert detect("{% if tools %}<seed:tool_call><function=f><parameter=p>") == "hermes"
    assert detect("[TOOL_CALLS] and no tool list") == "hermes"  # the generic format
    assert tool_format(TEMPLATE_MARKERS["mistral"], "hermes").name == "hermes"
    with pytest.raises(ValueError, match="qwen3_coder"):
        tool_format(None, "qwen3")




def test_the_published_templates_are_detected() -> None:
    """tests/chat_templates holds each family's published chat template."""
    folder = Path(__file__).parents[2] / "chat_templates"
    found = {p.stem: detect(p.read_text()) for p in folder.glob("*.jinja")
             if p.stem != "deepseek_r1"}  # a reasoning family's (test_reasoning.py)
    assert found == {f: f for f in FORMATS if f != "hermes"}


def test_mistral_call_ids_are_what_its_templates_take_back() -> None:
    for family in ("mistral", "mistral_args"):
        parser = FORMATS[family].parser(USE)
        parser.feed(SAMPLES[family][0])
        parser.finish()
        ids = [c["id"] for c in parser.calls]
        assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2, ids
