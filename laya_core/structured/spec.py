"""What a request constrains its output to, as data that crosses process boundaries."""

from __future__ import annotations

import attrs


@attrs.frozen
class ConstraintSpec:
    """One request's output constraint.

    ``grammar`` is llguidance's grammar text (a Lark grammar, or the JSON of its
    ``{"grammars": [...]}`` form), complete: equal texts constrain equally, so it is the
    compile cache's key. With ``convert`` it is the client's own grammar text, Lark or GBNF,
    which the compiler converts (in its child process: the conversion is quadratic in the
    rules, :mod:`laya_core.structured.sandbox`). ``param`` is the request field it came
    from, for errors. ``numbers``, for JSON, is a second grammar (a regular expression of
    Laya's own, :func:`laya_core.structured.formats.numbers_grammar`) that the output must
    match too: it bounds the digits of every JSON number, which llguidance's JSON
    grammars leave unbounded. ``parts``, for a grammar built of others (tool calls or a
    JSON answer), are those others: compiled alone only when the whole is refused, so that
    the error names the field whose schema the server cannot enforce.
    """

    kind: str  # json_schema, json_object, regex, choice, grammar, tools, tools_or_json
    grammar: str
    param: str
    convert: bool = False
    numbers: str = ""
    parts: tuple[ConstraintSpec, ...] = ()


class GrammarError(ValueError):
    """A constraint that cannot be compiled or enforced; the HTTP side answers 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
