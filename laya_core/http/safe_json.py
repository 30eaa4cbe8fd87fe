"""Parsing a request body into JSON values that every later step can use safely.

``json.loads`` accepts more than the rest of the server can handle: lone UTF-16 surrogates
(``"\\ud800"``, which cannot be encoded to UTF-8 for the tokenizer or passed to the C++
router), ``NaN`` and ``Infinity`` literals, ``1e400`` (infinity), integers of any size (which
overflow when made floats or C integers) and nesting as deep as the interpreter's recursion
limit. :func:`loads` refuses all of them with a 400 naming the field, e.g.
``messages[0].content``. A field whose value is JSON inside a string (a history call's
``arguments``) escapes that check, so it is parsed with :func:`loads_field`, which applies
the same rules and names the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from laya_core.http.errors import APIError, invalid

MAX_DEPTH = 64  # arrays and objects; OpenAI bodies nest about 5 deep
INT64 = 2**63  # integers must lie in [-INT64, INT64), as in OpenAI's own schema (seed)
_SURROGATE = re.compile("[\ud800-\udfff]")  # a pair became one code point; these are alone


class _Bad(Exception):
    """A refused value; the path to it is collected while the walk unwinds."""

    def __init__(self, problem: str, code: str, whole_field: bool = False) -> None:
        super().__init__(problem)
        self.problem = problem
        self.code = code
        self.whole_field = whole_field  # name the top-level field only (deep nesting)
        self.path: list[str | int] = []  # innermost first


def loads(data: bytes | bytearray | str) -> Any:
    """The JSON value of ``data``, or :class:`APIError` 400 naming what was refused."""
    try:
        value = json.loads(data)
    except RecursionError:  # nested deeper than the interpreter's limit (about 1000)
        raise invalid("body", f"the body nests arrays and objects more than {MAX_DEPTH} "
                      "levels deep", "too_deep") from None
    except ValueError as e:  # includes UnicodeDecodeError and over-long integers
        raise invalid("body", f"the body is not valid JSON: {e}", "invalid_json") from None
    try:
        _check(value, 1)
    except _Bad as bad:
        raise _error(bad) from None
    return value


def loads_field(text: str, param: str) -> Any:
    """The JSON value of the string field ``param`` (e.g.
    ``messages[3].tool_calls[0].function.arguments``), refused as :func:`loads` refuses a
    body: :class:`APIError` 400 naming ``param``. Its nesting counts from the string, so it
    may nest :data:`MAX_DEPTH` levels of its own."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise invalid(param, f"'{param}' nests arrays and objects more than {MAX_DEPTH} "
                      "levels deep", "too_deep") from None
    except ValueError as e:
        raise invalid(param, f"'{param}' is not valid JSON: {e}", "invalid_json") from None
    try:
        _check(value, 1)
    except _Bad as bad:
        inside = _field_path(bad.path[::-1]) if not bad.whole_field else ""
        where = f" (at {inside})" if inside else ""
        raise invalid(param, f"'{param}'{where} {bad.problem}", bad.code) from None
    return value


def _error(bad: _Bad) -> APIError:
    parts = bad.path[::-1]
    if bad.whole_field:  # the path to a too-deep value is as long as it is deep
        parts = [part for part in parts[:1] if isinstance(part, str)]
    if not parts:
        return invalid("body", f"the body {bad.problem}", bad.code)
    param = _field_path(parts)
    return invalid(param, f"'{param}' {bad.problem}", bad.code)


def _field_path(parts: list[str | int]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _check(value: Any, depth: int) -> None:
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise _Bad("holds a lone UTF-16 surrogate (\\ud800-\\udfff); send valid Unicode "
                       "text (a pair for characters beyond U+FFFF)", "invalid_string")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _Bad("must be a finite number (NaN, Infinity and numbers beyond 1.8e308 "
                       "are refused)", "invalid_value")
    elif isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise _Bad("is a number too large for any field (an integer must fit in 64 "
                       "bits, -2**63 to 2**63 - 1)", "invalid_value")
    elif isinstance(value, (list, dict)):
        if depth > MAX_DEPTH:
            raise _Bad(f"nests arrays and objects more than {MAX_DEPTH} levels deep",
                       "too_deep", whole_field=True)
        if isinstance(value, list):
            _check_items(value, depth + 1)
        else:
            _check_members(value, depth + 1)


def _check_items(items: list[Any], depth: int) -> None:
    # Token ids are the common long array: check them at C speed (800k ids: 75 ms -> 30 ms).
    if items and set(map(type, items)) == {int} and -INT64 <= min(items) \
            and max(items) < INT64:
        return
    for i, item in enumerate(items):
        if type(item) is not int or not -INT64 <= item < INT64:
            try:
                _check(item, depth)
            except _Bad as bad:
                bad.path.append(i)
                raise


def _check_members(members: dict[str, Any], depth: int) -> None:
    for key, item in members.items():
        if _SURROGATE.search(key):
            bad = _Bad("is a field name holding a lone UTF-16 surrogate", "invalid_string")
            bad.path.append(ascii(key)[1:-1])  # escaped, so the error itself is valid JSON
            raise bad
        try:
            _check(item, depth)
        except _Bad as bad:
            bad.path.append(key)
            raise
