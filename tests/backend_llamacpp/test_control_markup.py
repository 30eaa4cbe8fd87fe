"""A family's markup as control tokens (laya_core/structured/markup.py), on a real llama.cpp
vocabulary: the embedded model's with ten of its unused control tokens renamed to Llama 3's,
Mistral's and gpt-oss's markup, as those families' vocabularies have it. The grammars must
write each piece as its one token (a string literal would only allow it spelt in ordinary
tokens, which such a model never writes), in a forced call and after free text (``tool_choice``
auto), and the output must show the tokens as their text for the parsers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hostile_gguf import FAMILY_CONTROLS, embedded, with_tokens

from laya_core.backend import ModelConfig, ModelInfo
from laya_core.engine.detokenizer import IncrementalDetokenizer
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.markup import control_ids, lark_literal
from laya_core.structured.spec import ConstraintSpec
from laya_core.structured.tool_formats import tool_format
from laya_core.structured.tools import Tool, ToolUse, call_grammar

CONTROLS = FAMILY_CONTROLS
END = 2  # <|im_end|>
WEATHER = Tool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False})
# Per family: a call as the model writes it (control tokens by name), after its trigger.
CALLS = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "harmony": "<|channel|>commentary to=functions.get_weather <|constrain|>json"
               '<|message|>{"city": "Paris"}<|call|>',
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from laya_backend_llamacpp.backend import LlamaCppBackend

    path = with_tokens(embedded(), tmp_path_factory.mktemp("controls") / "m.gguf", CONTROLS)
    tok = LlamaCppBackend(ModelConfig(name="m", backend="llama.cpp", path=str(path))) \
        .load_tokenizer()
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def compiler(tokenizer: object) -> Iterator[GrammarCompiler]:
    info = ModelInfo(n_ctx_train=2048, vocab_size=tokenizer.vocab_size,  # type: ignore[attr-defined]
                     eog_token_ids=frozenset({END}), chat_template=None, bos_token="",
                     eos_token="<|im_end|>", add_bos=False,
                     special_tokens=tokenizer.special_tokens)  # type: ignore[attr-defined]
    c = GrammarCompiler(tokenizer, info)  # type: ignore[arg-type]
    yield c
    c.close()


def accepts(compiler: GrammarCompiler, spec: ConstraintSpec, ids: list[int]) -> bool:
    constraint = compiler.constraint(spec)
    return all(constraint(ids[:i]).allows(ids[i]) for i in range(len(ids))) \
        and constraint(ids).allows(END)


def test_the_renamed_tokens_are_control_tokens(tokenizer: object) -> None:
    ids = control_ids(tokenizer)  # type: ignore[arg-type]
    assert {text: ids[text] for text in CONTROLS.values()} == \
        {text: token for token, text in CONTROLS.items()}
    assert lark_literal("[TOOL_CALLS]x[ARGS]", (("[TOOL_CALLS]", 4), ("[ARGS]", 5))) == \
        '<[4]> "x" <[5]>'


@pytest.mark.parametrize("family", CALLS)
def test_each_family_writes_its_markup_as_control_tokens(
        tokenizer: object, compiler: GrammarCompiler, family: str) -> None:
    fmt = tool_format(None, family, tokenizer)  # type: ignore[arg-type]
    assert fmt.controls and all(CONTROLS[token] == text for text, token in fmt.controls)
    call = CALLS[family]
    as_tokens = tokenizer.encode(call, add_special=False, parse_special=True)  # type: ignore[attr-defined]
    spelt = tokenizer.encode(call, add_special=False, parse_special=False)  # type: ignore[attr-defined]
    # (llama.cpp reads gpt-oss's <|channel|>, <|message|>, <|start|> and <|constrain|> as
    # user-defined tokens, from text too, as its vocabulary loader marks them; <|call|>
    # stays a control token.)
    assert set(as_tokens) & set(CONTROLS) and spelt != as_tokens
    if family == "llama3_json":  # a forced call is bare JSON; the tag is auto's trigger
        forced_call = call.removeprefix("<|python_tag|>")
        as_forced = tokenizer.encode(forced_call, add_special=False)  # type: ignore[attr-defined]
    else:
        as_forced = as_tokens
    forced = call_grammar(ToolUse((WEATHER,), "required"), fmt=fmt)
    assert accepts(compiler, forced, as_forced)
    if family != "llama3_json":
        assert not accepts(compiler, forced, spelt)  # the markup spelt in text: refused
    auto = call_grammar(ToolUse((WEATHER,)), fmt=fmt)
    before = tokenizer.encode("Let me see. ", add_special=False)  # type: ignore[attr-defined]
    assert accepts(compiler, auto, before + as_tokens)  # free text, then the trigger token
    if family != "harmony":  # (whose <|channel|> is a token even in text)
        assert accepts(compiler, auto, before + spelt)  # the markup spelt out is only text
    # From the trigger token on, the call is constrained: a wrong tool name is refused.
    wrong = tokenizer.encode(call.replace("get_weather", "get_rain"),  # type: ignore[attr-defined]
                             add_special=False, parse_special=True)
    assert not accepts(compiler, auto, before + wrong)


def test_the_output_shows_the_markup_it_is_asked_to(tokenizer: object) -> None:
    ids = tokenizer.encode(CALLS["mistral_args"], add_special=False)  # type: ignore[attr-defined]
    plain = IncrementalDetokenizer(tokenizer.token_bytes)  # type: ignore[attr-defined]
    assert "".join(plain.add(t)[0] for t in ids) == 'get_weather{"city": "Paris"}'
    shown = IncrementalDetokenizer(tokenizer.token_bytes,  # type: ignore[attr-defined]
                                   shown=((4, "[TOOL_CALLS]"), (5, "[ARGS]")))
    assert "".join(shown.add(t)[0] for t in ids) == CALLS["mistral_args"]



def test_harmony_with_tools_auto_lets_messages_come_before_a_call(
        tokenizer: object, compiler: GrammarCompiler) -> None:
    """gpt-oss reasons in its analysis channel before it calls or answers: with its channel
    markup as control tokens, ``tool_choice`` auto must let that message come first."""
    auto = call_grammar(ToolUse((WEATHER,)), fmt=tool_format(None, "harmony", tokenizer))  # type: ignore[arg-type]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special=False, parse_special=True)  # type: ignore[attr-defined,no-any-return]

    analysis = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    assert accepts(compiler, auto, ids(analysis + CALLS["harmony"]))
    assert accepts(compiler, auto, ids(analysis + "<|channel|>final<|message|>It is sunny."))
    assert accepts(compiler, auto, ids("Just text."))
    assert not accepts(compiler, auto, ids(analysis + CALLS["harmony"].replace(
        "get_weather", "get_rain")))
