"""Tools with a typed answer: ``tools`` beside a JSON response format, as one constraint
(call, or answer in the format) and as the request fields that ask for it."""

from __future__ import annotations

from typing import Any

import pytest
from toy_backend import END, ToyTokenizer

from laya_core.backend import ModelInfo
from laya_core.http.chat_requests import parse_chat
from laya_core.http.errors import APIError
from laya_core.http.responses_format import parse_responses, renamed
from laya_core.structured import formats
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.spec import GrammarError
from laya_core.structured.tools import Tool, ToolUse, call_grammar

TOY_INFO = ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                     chat_template=None, bos_token="", eos_token="", add_bos=False)
WEATHER = Tool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False})
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = '{"name": "Paris", "population": 2100000}'
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": WEATHER.parameters}}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": CITY}}}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ToyTokenizer(), TOY_INFO)


def allowed(compiler: GrammarCompiler, spec: Any, text: str) -> set[str]:
    """The next characters ``spec`` allows after ``text``; "END" where it may end."""
    mask = compiler.constraint(spec)(list(text.encode()))
    return {"END" if t == END else chr(t) for t in mask.token_ids()}


def accepts(compiler: GrammarCompiler, spec: Any, text: str) -> bool:
    return all(text[i] in allowed(compiler, spec, text[:i]) for i in range(len(text))) \
        and "END" in allowed(compiler, spec, text)


def test_auto_with_a_schema_is_a_call_or_the_answer(compiler: GrammarCompiler) -> None:
    answer = formats.json_schema(CITY, "response_format.json_schema.schema")
    spec = call_grammar(ToolUse((WEATHER,), "auto"), answer=answer)
    assert spec.kind == "tools_or_json"
    assert allowed(compiler, spec, "") == {"{", "<"}  # no text before either
    assert accepts(compiler, spec, CALL) and accepts(compiler, spec, CALL + "\n" + CALL)
    assert accepts(compiler, spec, ANSWER)
    assert allowed(compiler, spec, '{"name": "Paris", "population": 2100000}') == {"END"}
    assert not accepts(compiler, spec, '{"city": "Paris"}')  # the schema's keys only
    assert not accepts(compiler, spec, "Sure. " + CALL)
    assert allowed(compiler, spec, '<tool_call>\n{"name": "') == {"g"}
    # An answer's numbers are bounded as a response format's are.
    digits = '{"name": "P", "population": ' + "9" * formats.MAX_INTEGER_DIGITS
    assert not allowed(compiler, spec, digits) & set("0123456789")
    parallel = call_grammar(ToolUse((WEATHER,), "auto", parallel=False), answer=answer)
    assert allowed(compiler, parallel, CALL) == {"END"}


def test_a_forced_call_leaves_the_answer_for_a_later_turn(compiler: GrammarCompiler) -> None:
    answer = formats.json_schema(CITY, "response_format.json_schema.schema")
    for choice in ("required", "get_weather"):
        spec = call_grammar(ToolUse((WEATHER,), choice), answer=answer)
        assert spec == call_grammar(ToolUse((WEATHER,), choice))
        assert allowed(compiler, spec, "") == {"<"}


def test_any_json_object_may_answer(compiler: GrammarCompiler) -> None:
    answer = formats.from_body({"response_format": {"type": "json_object"}})
    spec = call_grammar(ToolUse((WEATHER,), "auto"), answer=answer)
    assert accepts(compiler, spec, '{"anything": [1, 2]}') and accepts(compiler, spec, CALL)
    assert not accepts(compiler, spec, "[1]")
    compact = formats.from_body({"structured_outputs": {"json": CITY,
                                                        "disable_any_whitespace": True}})
    spec = call_grammar(ToolUse((WEATHER,), "auto"), answer=compact)
    assert allowed(compiler, spec, "{") == {'"'}


def test_a_refusal_names_the_field_whose_schema_it_cannot_enforce(
        compiler: GrammarCompiler) -> None:
    unique = {"type": "array", "uniqueItems": True}
    bad_answer = formats.json_schema(unique, "response_format.json_schema.schema")
    bad_tool = Tool("f", None, {"type": "object", "properties": {"x": unique}})
    for tool, answer, param in (
            (WEATHER, bad_answer, "response_format.json_schema.schema"),
            (bad_tool, formats.json_schema(CITY, "response_format.json_schema.schema"),
             "tools")):
        with pytest.raises(GrammarError) as e:
            compiler.constraint(call_grammar(ToolUse((tool,), "auto"), answer=answer))
        assert e.value.param == param and "uniqueItems" in str(e.value)


def test_chat_takes_tools_beside_a_json_format_and_refuses_other_constraints() -> None:
    req = parse_chat(CHAT)
    assert req.tools is not None and req.common.constraint is not None
    assert req.common.constraint.kind == "tools_or_json"
    forced = parse_chat({**CHAT, "tool_choice": "required"})
    assert forced.common.constraint is not None and forced.common.constraint.kind == "tools"
    alone = parse_chat({**CHAT, "tool_choice": "none"})  # the tools are not shown
    assert alone.tools is None and alone.common.constraint is not None
    assert alone.common.constraint.kind == "json_schema"
    for other, param in (({"guided_regex": "a+"}, "guided_regex"),
                         ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice")):
        body = {**CHAT, "response_format": None, **other}
        with pytest.raises(APIError) as e:
            parse_chat(body)
        assert e.value.param == param and "json_schema or json_object" in e.value.message


def test_responses_take_function_tools_beside_text_format() -> None:
    req = parse_responses({"model": "m", "input": "Hi", "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER.parameters}],
        "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY}}})
    assert req.chat.tools is not None and req.chat.common.constraint is not None
    assert req.chat.common.constraint.kind == "tools_or_json"
    assert req.echo["text"]["format"]["name"] == "city"


def test_a_responses_refusal_names_the_responses_field() -> None:
    error = renamed(APIError(400, "'response_format.json_schema.schema' uses the JSON-schema "
                             "keyword(s) uniqueItems", param="response_format.json_schema.schema"))
    assert error.param == "text.format.schema"
    assert error.message.startswith("'text.format.schema' uses")
