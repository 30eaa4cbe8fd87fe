"""Structured output in the core: request fields to one constraint, the compiler and its
cache, and the tool-call parser at every split of a stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from toy_backend import END, ToyTokenizer

from laya_core.backend import ModelInfo
from laya_core.serving.chat_template import ChatTemplate
from laya_core.structured import formats
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.spec import GrammarError
from laya_core.structured.tools import Tool, ToolCallParser, ToolUse, call_grammar

TOY_INFO = ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                     chat_template=None, bos_token="", eos_token="", add_bos=False)
WEATHER = Tool("get_weather", "The weather", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False})
NO_ARGS = Tool("now", None, {})


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ToyTokenizer(), TOY_INFO)


def allowed(compiler: GrammarCompiler, spec: Any, text: str) -> set[str]:
    """The next characters ``spec`` allows after ``text`` (the toy's tokens are bytes);
    "END" where the output may end."""
    mask = compiler.constraint(spec)(list(text.encode()))
    return {"END" if t == END else chr(t) for t in mask.token_ids()}


def test_each_spelling_gives_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    found = [formats.from_body(body) for body in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                      "schema": schema}}},
        {"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)})]
    assert [s.kind for s in found if s] == ["json_schema"] * 3
    assert len({s.grammar for s in found if s}) == 1  # one cache entry for all three
    assert formats.from_body({"response_format": {"type": "text"}}) is None
    with pytest.raises(GrammarError) as e:
        formats.from_body({"response_format": {"type": "json_object"}, "guided_regex": "a"})
    assert e.value.param == "guided_regex"


def test_a_schema_is_compiled_once_and_its_errors_name_the_keyword(
        compiler: GrammarCompiler) -> None:
    spec = formats.json_schema({"type": "object"}, "response_format")
    before = compiler.compiled
    assert allowed(compiler, spec, "") == {"{"}
    assert allowed(compiler, spec, "{}") == {"END"}
    assert compiler.compiled == before + 1  # the second request was a cache hit
    for schema, keyword in (({"type": "array", "uniqueItems": True}, "uniqueItems"),
                            ({"type": "string", "pattern": "(?=a)b"}, "look-around")):
        bad = formats.json_schema(schema, "response_format.json_schema.schema")
        for _ in range(2):  # the refusal is cached, and still raised
            with pytest.raises(GrammarError) as e:
                compiler.constraint(bad)
            assert e.value.param == "response_format.json_schema.schema"
            assert keyword in str(e.value)


def test_whitespace_between_json_tokens_is_bounded(compiler: GrammarCompiler) -> None:
    spec = formats.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}},
                               "x")
    assert " " in allowed(compiler, spec, "{" + " " * 1)
    assert " " not in allowed(compiler, spec, "{" + " " * 2)
    assert " " in allowed(compiler, spec, "{\n" + " " * 31)
    assert " " not in allowed(compiler, spec, "{\n" + " " * 32)
    assert "\n" not in allowed(compiler, spec, "{\n")
    compact = formats.from_body({"structured_outputs": {"json": {"type": "object"},
                                                        "disable_any_whitespace": True}})
    assert allowed(compiler, compact, "{") == {'"', "}"}


def test_closed_objects_and_choices(compiler: GrammarCompiler) -> None:
    closed = formats.from_body({"structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "disable_additional_properties": True, "disable_any_whitespace": True}})
    assert allowed(compiler, closed, '{"a":1,') == set()  # nothing may follow a closed a
    choice = formats.from_body({"guided_choice": ["yes", "no"]})
    assert allowed(compiler, choice, "") == {"y", "n"}
    assert allowed(compiler, choice, "yes") == {"END"}
    gbnf = formats.from_body({"guided_grammar": 'root ::= "a" [0-9]+'})
    assert allowed(compiler, gbnf, "a") == set("0123456789")


DIGITS = set("0123456789")


def test_numbers_end_within_their_bounds(compiler: GrammarCompiler) -> None:
    """A greedy model wrote ``"population": 1112800000...`` until the context ended: the
    digits of an integer, a fraction and an exponent are bounded, strings are not."""
    whole = "9" * formats.MAX_INTEGER_DIGITS
    city = formats.json_schema({"type": "object", "properties": {
        "population": {"type": "integer"}}}, "x")
    assert allowed(compiler, city, '{"population": ' + whole[:-1]) >= DIGITS
    assert not allowed(compiler, city, '{"population": ' + whole) & DIGITS
    assert allowed(compiler, city, '{"population": -' + whole) == {" ", "\n", ",", "}"}
    number = formats.json_schema({"type": "number"}, "x")
    fraction = "0." + "1" * formats.MAX_FRACTION_DIGITS
    assert allowed(compiler, number, fraction[:-1]) >= DIGITS
    assert not allowed(compiler, number, fraction) & DIGITS
    assert "END" in allowed(compiler, number, fraction)
    exponent = "1e+" + "3" * formats.MAX_EXPONENT_DIGITS
    assert allowed(compiler, number, exponent[:-1]) >= DIGITS
    assert allowed(compiler, number, exponent) == {"END"}
    free = formats.from_body({"response_format": {"type": "json_object"}})
    assert not allowed(compiler, free, '{"a": [1, ' + whole) & DIGITS
    # A string's digits are text: '"', escapes and all.
    assert allowed(compiler, free, '{"a": "\\"' + whole * 3) >= DIGITS
    forced = call_grammar(ToolUse((Tool("f", None, {"type": "object", "properties": {
        "n": {"type": "number"}}}),), "required"))
    assert not allowed(compiler, forced, '<tool_call>\n{"name": "f", "arguments": {"n": '
                       + whole) & DIGITS


def test_ordinary_numbers_pass_and_a_schema_may_need_more_digits(
        compiler: GrammarCompiler) -> None:
    def accepts(schema: Any, text: str) -> bool:
        spec = formats.json_schema(schema, "x")
        return all(text[i] in allowed(compiler, spec, text[:i]) for i in range(len(text))) \
            and "END" in allowed(compiler, spec, text)

    for text in ("0", "-7", "42", "3.25", "-0.5e-3", "6.02E+23", "1e308", "-1.7976931348623157e308",
                 "0.000001234567890123456", "18446744073709551615"):
        assert accepts({"type": "number"}, text), text
    assert accepts({"type": "array", "items": {"type": "integer"}}, "[1, -20, 300]")
    # A schema's own numbers with more digits than the bounds make room for them
    # (llguidance itself takes no bound of 1e19 or more on an integer or a number).
    assert not accepts({"type": "number"}, "1" * 25)
    assert accepts({"anyOf": [{"type": "number"}, {"const": 1e24}]}, "1" * 25)
    assert not accepts({"type": "number"}, "0." + "1" * 26)
    assert accepts({"type": "number", "minimum": 1e-26}, "0." + "1" * 26)
    assert formats._digits_needed({"maximum": 10**400, "minimum": 1e-5}) == (309, 5)


def test_a_matcher_that_was_fed_what_it_forbids_allows_nothing(
        compiler: GrammarCompiler) -> None:
    constraint = compiler.constraint(formats.json_schema({"type": "object"}, "x"))
    assert constraint(list(b"[")).is_empty()


def test_tool_grammars(compiler: GrammarCompiler) -> None:
    both = (WEATHER, NO_ARGS)
    required = call_grammar(ToolUse(both, "required"))
    assert allowed(compiler, required, "") == {"<"}
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert allowed(compiler, required, call) == {"END", "\n"}  # parallel: another may follow
    single = call_grammar(ToolUse(both, "required", parallel=False))
    assert allowed(compiler, single, call) == {"END"}
    named = call_grammar(ToolUse(both, "get_weather"))
    assert allowed(compiler, named, '<tool_call>\n{"name": "') == {"g"}
    auto = call_grammar(ToolUse(both, "auto"))
    assert "E" in allowed(compiler, auto, "Plain text, no call")  # free text
    assert allowed(compiler, auto, "Let me look. <tool_call>\n") == {"{"}  # a call, checked
    with pytest.raises(GrammarError) as e:
        compiler.constraint(call_grammar(ToolUse((Tool("f", None, {
            "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}),),
            "required")))
    assert "uniqueItems" in str(e.value)


STREAM = ('I will look that up. <tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Par\\"is {x}", "days": [1, {"n": 2}]}}\n</tool_call>\n<tool_call>\n'
          '{"name": "now", "arguments": {}}\n</tool_call>')


def parsed(pieces: list[str]) -> tuple[str, list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """The content, the calls, and the calls rebuilt from their stream deltas."""
    parser = ToolCallParser()
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    content = "".join(v for kind, v in deltas if kind == "content")
    rebuilt: dict[int, dict[str, Any]] = {}
    for kind, v in deltas:
        if kind == "call" and "id" in v:
            assert v["index"] not in rebuilt and v["function"]["name"]
            rebuilt[v["index"]] = {"id": v["id"], "name": v["function"]["name"],
                                   "arguments": v["function"]["arguments"]}
        elif kind == "call":
            rebuilt[v["index"]]["arguments"] += v["function"]["arguments"]
    return content, parser.calls, rebuilt


def test_streamed_arguments_survive_every_split() -> None:
    whole_content, whole_calls, _ = parsed([STREAM])
    assert whole_content == "I will look that up. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole_calls] == [
        ("get_weather", {"city": 'Par"is {x}', "days": [1, {"n": 2}]}), ("now", {})]
    for i in range(len(STREAM) + 1):
        for j in range(i, len(STREAM) + 1, 7):
            content, calls, rebuilt = parsed([STREAM[:i], STREAM[i:j], STREAM[j:]])
            assert content == whole_content, (i, j)
            assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
            assert [(r["name"], r["arguments"]) for r in rebuilt.values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls], (i, j)
    # One character at a time, as a stream of single-character tokens arrives.
    assert parsed(list(STREAM))[1][0]["function"] == whole_calls[0]["function"]


def expected_cut(c: int) -> tuple[str, list[tuple[str, str]], bool]:
    """What STREAM cut after ``c`` characters must give: the content, the calls (name,
    arguments so far) and whether every call is complete. A call is a call once its name
    closed; before that it is content, exactly as generated; markers and the layout between
    calls are not content."""
    content, calls, complete = "", [], True
    at = 0
    for k in range(STREAM.count("<tool_call>")):
        opened = STREAM.index("<tool_call>", at)
        if k == 0:
            content = STREAM[:min(c, opened)]
        name_end = STREAM.index('", "arguments"', opened) + 1
        args_start = STREAM.index("{", STREAM.index('"arguments":', opened))
        args_end = STREAM.index("}\n</tool_call>", opened)  # the call's own } follows
        if opened < c < name_end:
            content += STREAM[opened:c]
        if c >= name_end:
            name = json.loads(STREAM[STREAM.index('"name": ', opened) + 8:name_end])
            calls.append((name, STREAM[args_start:min(c, args_end)] if c > args_start else ""))
            complete = complete and c >= args_end
        at = args_end
    return content, calls, complete


def test_a_cut_output_keeps_what_was_generated_at_every_cut_and_split() -> None:
    """``max_tokens`` may end the text anywhere: streamed at any split or not, the reply is
    the same and holds all it generated (:func:`expected_cut`)."""
    for c in range(len(STREAM) + 1):
        cut = STREAM[:c]
        content, calls, complete = expected_cut(c)
        parser = ToolCallParser()
        parser.feed(cut)
        parser.finish()
        assert parser.complete == complete, c
        for i in range(c + 1):
            got_content, got_calls, rebuilt = parsed([cut[:i], cut[i:]])
            assert got_content == content, (c, i)
            assert [(x["function"]["name"], x["function"]["arguments"])
                    for x in got_calls] == calls, (c, i)
            assert [(r["name"], r["arguments"]) for r in rebuilt.values()] == calls, (c, i)


def test_a_call_cut_inside_its_name_is_text_not_a_call() -> None:
    """A name's beginning may be another tool's whole name ("get" of "get_weather"), so a
    call cut before its name closed is not dispatchable: it comes back as the text it is."""
    content, calls, _ = parsed(['<tool_call>\n{"name": "get'])
    assert (content, calls) == ('<tool_call>\n{"name": "get', [])
    content, calls, _ = parsed(['<tool_call>\n{"name": "get"'])  # closed: a call
    assert content == "" and [c["function"] for c in calls] == [{"name": "get",
                                                                 "arguments": ""}]


def test_text_that_only_looks_like_a_call_is_content() -> None:
    content, calls, _ = parsed(["Compare a < b and <tool", "_c"])
    assert content == "Compare a < b and <tool_c" and calls == []
    content, calls, _ = parsed(["The end <tool_ca"])
    assert content == "The end <tool_ca" and calls == []


def test_tool_aware_templates_get_plain_json_and_break() -> None:
    template = ChatTemplate(
        "{% for t in tools %}{{ t | tojson }}{% endfor %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    text = template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                           tools=[{"type": "function", "function": {"description": "x < y"}}])
    assert text == '{"type": "function", "function": {"description": "x < y"}}a'


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function'] | tojson }}{% endfor %}"
    "</tools>{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']['arguments'] | tojson }}"
    "</call>{% endfor %}{% endfor %}")
HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": {"city": "Paris"},
                   "raw_arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]


def test_a_tool_aware_template_renders_tools_and_calls_itself() -> None:
    from laya_core.structured.tools import prompt_messages

    messages, tools = prompt_messages(HISTORY, ToolUse((WEATHER,)), TOOL_TEMPLATE)
    text = ChatTemplate(TOOL_TEMPLATE).render(messages, tools=tools)
    assert text.startswith('<tools>{"name": "get_weather", "description": "The weather", '
                           '"parameters": {"type": "object"')
    assert '[assistant]<call>{"city": "Paris"}</call>[tool]21 C' in text


def test_a_template_without_tools_gets_the_generic_format() -> None:
    from laya_core.serving.chat_template import CHATML
    from laya_core.structured.tools import prompt_messages

    messages, tools = prompt_messages(HISTORY, ToolUse((WEATHER,)), None)
    assert tools is None
    text = ChatTemplate(CHATML).render(messages)
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '{"name": "get_weather", "description": "The weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text


def test_a_mask_spans_the_model_rows_past_the_tokenizer() -> None:
    """Padded embeddings: the model's rows (288) outnumber the tokenizer's ids (257); the
    mask has the model's width and never allows an id no text maps to."""
    import attrs

    compiler = GrammarCompiler(ToyTokenizer(), attrs.evolve(TOY_INFO, vocab_size=288))
    mask = compiler.constraint(formats.from_body({"guided_regex": ".+"}))([])  # type: ignore[arg-type]
    assert mask.vocab_size == 288 and mask.allows(ord("a"))
    assert not any(mask.allows(t) for t in range(257, 288))
