"""Request fields that constrain the output, turned into one :class:`ConstraintSpec`.

Three spellings are accepted, with one constraint per request:

- OpenAI's ``response_format``: ``text``, ``json_object``, ``json_schema`` (name, schema, strict);
- vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  and ``json_object``, with ``disable_any_whitespace``, ``disable_additional_properties`` and
  ``whitespace_pattern``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``.

Each source is checked for size (:mod:`laya_core.structured.precheck`) before anything is
built from it; the conversion of a GBNF grammar and every compile happen in the replica's
compiler, off the event loop (:mod:`laya_core.structured.compiler`).

JSON is generated with bounded whitespace (:data:`DEFAULT_WHITESPACE`): between two JSON
tokens at most two spaces, or one line break and 32 spaces of indent, so a constrained
generation cannot spend its tokens on blanks (an unbounded pattern let a small model write
200 spaces). Numbers are bounded the same way (:func:`numbers_grammar`): at most
:data:`MAX_INTEGER_DIGITS` digits before the point, :data:`MAX_FRACTION_DIGITS` after it and
:data:`MAX_EXPONENT_DIGITS` in the exponent, or as many as the schema's own numbers need, so
a greedy model cannot write digits until the context ends (``"population": 1112800000...``
ran for 4,061 tokens). A schema is always enforced, or refused with the keyword it cannot
enforce; ``strict`` adds OpenAI's strict-mode rule that objects hold only the properties
they list.
"""

from __future__ import annotations

import decimal
import json
import math
from collections.abc import Mapping
from typing import Any

from laya_core.structured import precheck
from laya_core.structured.spec import ConstraintSpec, GrammarError

# One whitespace run between JSON tokens: a pretty-printed layout fits, a runaway does not.
DEFAULT_WHITESPACE = r"(?:[ ]{0,2}|\n[ ]{0,32})"
MAX_CHOICES = 4096
# The digits of a JSON number (docs/structured-output.md): an unsigned 64-bit
# integer has 20 (int64, 19); a double's 17 significant digits after the 6 zeros that
# JavaScript still writes before them (0.000000123...) are 23; its exponent goes to 308.
MAX_INTEGER_DIGITS = 20
MAX_FRACTION_DIGITS = 23
MAX_EXPONENT_DIGITS = 3
# A schema's number past a double's range means nothing more to the matcher (llguidance
# reads bounds as doubles): 1.8e308 has 309 digits.
_MOST_DIGITS = 309
# The request fields that carry an output constraint (tools become one too).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "tools")

# The kinds of a JSON constraint (a schema's or any object's), the ones tools combine with.
JSON_KINDS = ("json_schema", "json_object")

# The whitespace options of compact JSON (vLLM's disable_any_whitespace).
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def json_options(whitespace: str | None = None, compact: bool = False) -> dict[str, Any]:
    """llguidance's JSON options: the whitespace allowed between JSON tokens."""
    if compact:
        return dict(_COMPACT)
    return {"whitespace_flexible": True, "whitespace_pattern": whitespace or DEFAULT_WHITESPACE}


def _digits_needed(schema: Any) -> tuple[int, int]:
    """The integer and fraction digits the numbers in ``schema`` are written with, at most
    (a ``maximum`` of 10**25 needs 26 before the point, a ``multipleOf`` of 1e-30 30 after
    it); any number counts, a ``maxLength`` too, which only widens the bound a little."""
    whole = fraction = 0
    stack = [schema]
    while stack:  # the schema passed precheck: its values are bounded
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                continue
            if isinstance(value, int) and abs(value) >= 10 ** _MOST_DIGITS:
                whole = _MOST_DIGITS
                continue
            number = decimal.Decimal(repr(value) if isinstance(value, float) else value)
            sign, digits, exponent = number.as_tuple()
            assert isinstance(exponent, int)
            whole = max(whole, len(digits) + exponent)
            fraction = max(fraction, -exponent)
    return min(whole, _MOST_DIGITS), min(fraction, _MOST_DIGITS)


def numbers_grammar(schema: Any = None, controls: tuple[tuple[str, int], ...] = ()) -> str:
    """The grammar every JSON output must also match (:attr:`ConstraintSpec.numbers`): any
    JSON text whose numbers have at most :data:`MAX_INTEGER_DIGITS` digits before the
    point, :data:`MAX_FRACTION_DIGITS` after it and :data:`MAX_EXPONENT_DIGITS` in the
    exponent, or more where ``schema``'s own numbers need them. Strings (escapes
    included) pass unread; a number must be followed by what cannot continue one.
    ``controls``: control tokens (text, id) the output may hold between such texts (a
    tool-call format's markup, laya_core/structured/markup.py)."""
    import llguidance

    whole, fraction = _digits_needed(schema)
    whole = max(whole, MAX_INTEGER_DIGITS)
    fraction = max(fraction, MAX_FRACTION_DIGITS)
    number = (rf"-?(?:0|[1-9][0-9]{{0,{whole - 1}}})(?:\.[0-9]{{1,{fraction}}})?"
              rf"(?:[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}})?")
    string = r'"(?:[^"\\]|\\(?s:.))*"'
    other = r'[^"0-9\-]'  # outside strings and numbers
    after = r'[^"0-9\-+.eE]'  # what may follow a number
    text = rf"(?:{other}|{string}|{number}{after})*(?:{number})?"
    if not controls:
        return llguidance.LLMatcher.grammar_from_regex(text)
    tokens = " | ".join(f"<[{token}]>" for _, token in controls)
    some = rf"(?:{other}|{string}|{number}{after})+(?:{number})?|{number}"  # not empty
    return llguidance.LLMatcher.grammar_from_lark(
        f"start: TEXT? (({tokens}) TEXT?)*\nTEXT: /{some}/\n")


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object schema leaves it
    out (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):  # vLLM's guided_json takes a JSON string too
        if len(value) > precheck.MAX_CHARS:
            raise GrammarError(param, f"'{param}' has more than {precheck.MAX_CHARS:,} "
                               "characters, the most one output constraint may have")
        try:
            value = json.loads(value)
        except RecursionError:
            raise GrammarError(param, f"'{param}' nests too deeply") from None
        except ValueError as e:
            raise GrammarError(param, f"'{param}' is not valid JSON: {e}") from None
    if not isinstance(value, (Mapping, bool)):
        raise GrammarError(param, f"'{param}' must be a JSON schema (an object)")
    precheck.check_schema(value, param)
    return value


def json_schema(schema: Any, param: str, *, whitespace: str | None = None,
                compact: bool = False, closed: bool = False,
                kind: str = "json_schema") -> ConstraintSpec:
    import llguidance

    schema = _schema(schema, param)
    if closed:
        schema = closed_schema(schema)
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError(param, f"'{param}' is the schema false, which nothing satisfies")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=json_options(whitespace, compact))  # type: ignore[arg-type]
    except ValueError as e:  # nested deeper than its JSON parser takes, say
        raise GrammarError(param, f"'{param}' cannot be read as a JSON schema: {e}") from None
    return ConstraintSpec(kind, grammar, param, numbers=numbers_grammar(schema))


def schema_of(spec: ConstraintSpec) -> Any:
    """The schema of a JSON constraint (:data:`JSON_KINDS`) as :func:`json_schema` gave it
    to llguidance, its whitespace options included (``x-guidance``): what a grammar that
    embeds the same JSON writes after ``%json``."""
    assert spec.kind in JSON_KINDS, spec.kind
    (entry,) = json.loads(spec.grammar)["grammars"]
    return entry["json_schema"]


def regex(pattern: Any, param: str) -> ConstraintSpec:
    import llguidance

    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(param, f"'{param}' must be a non-empty regular expression")
    precheck.check_text(pattern, param)
    return ConstraintSpec("regex", llguidance.LLMatcher.grammar_from_regex(pattern), param)


def choice(options: Any, param: str) -> ConstraintSpec:
    import llguidance

    if not isinstance(options, list) or not options or len(options) > MAX_CHOICES \
            or not all(isinstance(o, str) and o for o in options):
        raise GrammarError(param, f"'{param}' must be a list of 1 to {MAX_CHOICES} "
                           "non-empty strings")
    precheck.check_choices(options, param)
    # One terminal, so one lexer (a DFA) tells the choices apart: as alternatives of the
    # start rule, more than 2,000 choices pass llguidance's limit on a parser row.
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in dict.fromkeys(options))
    return ConstraintSpec("choice", llguidance.LLMatcher.grammar_from_lark(lark), param)


def grammar(text: Any, param: str) -> ConstraintSpec:
    """A Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's), converted when
    compiled: telling them apart and converting GBNF take time that grows faster than the
    text (6 s for 3,000 GBNF rules), which the event loop must not spend."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(param, f"'{param}' must be a grammar (Lark or GBNF) as a string")
    precheck.check_grammar(text, param)
    return ConstraintSpec("grammar", text, param, convert=True)


def _response_format(value: Any) -> ConstraintSpec | None:
    param = "response_format"
    if not isinstance(value, Mapping):
        raise GrammarError(param, "'response_format' must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema({"type": "object"}, param, kind="json_object")
    if kind != "json_schema":
        raise GrammarError(f"{param}.type", "'response_format.type' must be text, "
                           f"json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError(f"{param}.json_schema", "'response_format.json_schema' must be an "
                           "object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError(f"{param}.json_schema.name",
                           "'response_format.json_schema.name' must be a non-empty string")
    strict = spec.get("strict", False)
    if not isinstance(strict, (bool, type(None))):
        raise GrammarError(f"{param}.json_schema.strict",
                           "'response_format.json_schema.strict' must be a boolean")
    # strict: OpenAI's meaning, every object closed to the properties it lists.
    return json_schema(spec.get("schema", {}), f"{param}.json_schema.schema",
                       closed=bool(strict))


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "disable_fallback", "backend")


def _structured_outputs(value: Any) -> ConstraintSpec | None:
    param = "structured_outputs"
    if not isinstance(value, Mapping):
        raise GrammarError(param, "'structured_outputs' must be an object")
    unknown = sorted(set(value) - set(_VLLM_KINDS) - set(_VLLM_OPTIONS))
    if unknown:
        raise GrammarError(f"{param}.{unknown[0]}", f"'{param}.{unknown[0]}' is not supported; "
                           f"give one of {', '.join(_VLLM_KINDS)}")
    given = [k for k in _VLLM_KINDS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise GrammarError(f"{param}.{given[1]}", f"'{param}' takes one constraint; it has "
                           f"{' and '.join(given)}")
    compact = value.get("disable_any_whitespace", False)
    closed = value.get("disable_additional_properties", False)
    whitespace = value.get("whitespace_pattern")
    for key, ok in (("disable_any_whitespace", isinstance(compact, bool)),
                    ("disable_additional_properties", isinstance(closed, bool)),
                    ("whitespace_pattern", whitespace is None or isinstance(whitespace, str))):
        if not ok:
            raise GrammarError(f"{param}.{key}", f"'{param}.{key}' has the wrong type")
    if whitespace is not None:
        precheck.check_text(whitespace, f"{param}.whitespace_pattern")
    if not given:
        return None
    kind = given[0]
    sub = f"{param}.{kind}"
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value[kind]
        return json_schema(schema, sub, whitespace=whitespace, compact=compact, closed=closed,
                           kind="json_object" if kind == "json_object" else "json_schema")
    return {"regex": regex, "choice": choice, "grammar": grammar}[kind](value[kind], sub)


_GUIDED = {"guided_json": lambda v, p: json_schema(v, p), "guided_regex": regex,
           "guided_choice": choice, "guided_grammar": grammar}


def from_body(body: Mapping[str, Any]) -> ConstraintSpec | None:
    """The one output constraint a request body asks for, or None; raises
    :class:`GrammarError` naming the field for a malformed one, or for two."""
    specs: list[ConstraintSpec] = []
    if body.get("response_format") is not None:
        found = _response_format(body["response_format"])
        specs += [found] if found else []
    if body.get("structured_outputs") is not None:
        found = _structured_outputs(body["structured_outputs"])
        specs += [found] if found else []
    for key, build in _GUIDED.items():
        if body.get(key) is not None:
            specs.append(build(body[key], key))
    if len(specs) > 1:
        raise GrammarError(specs[1].param, f"a request takes one output constraint; it has "
                           f"{' and '.join(s.param for s in specs)}")
    return specs[0] if specs else None
