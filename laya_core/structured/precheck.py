"""Cheap checks on a constraint's source, run where the request is parsed (the event loop).

They refuse what is obviously too big to compile before anything compiles, with a 400 that
names the field and the limit. Each check is linear in the source and stops at its first
excess, so a hostile body costs the loop at most a few milliseconds. What they let through
is compiled in a bounded child process (:mod:`laya_core.structured.sandbox`), which refuses
the rest: these limits keep that child's refusals rare and their messages precise.

The numbers, measured with llguidance 1.9.1 on an Intel Xeon (2 vCPUs), and OpenAI's own
structured-output limits where they are documented:

- 256 KiB of source text (regex, grammar, all of a schema's strings, all choices): a 3 MB
  regex literal took 0.66 s to compile, 1.5 s for its first mask and 215 MiB.
- 2,000 properties in a schema (OpenAI allows 5,000): optional ones compile in quadratic
  time, 0.28 s for 1,000, 0.9 s for 2,000 and 14 s for 10,000.
- 5,000 enum values (28 ms to compile); 100,000 took 0.33 s and exceed the matcher's lexer.
- a depth of 128 through nesting and ``$ref``: a chain of 1,500 ``$ref`` or 1,000 nested
  objects overflows a 4 MiB stack (SIGSEGV), 5,000 an 8 MiB one.
- 1,000 grammar rules: a chain of 1,500 Lark rules overflows a 4 MiB stack, and converting
  GBNF to Lark is quadratic (0.74 s for 1,000 rules, 6.3 s for 3,000).
- counted repetitions up to 10,000 (``a{1000000}`` built 86 MiB of regex states for one mask).
"""

from __future__ import annotations

import re
from typing import Any

from laya_core.structured.spec import GrammarError

MAX_CHARS = 256 * 1024
MAX_SCHEMA_NODES = 20_000  # JSON values in a schema: a bound on the walk itself
MAX_SCHEMA_DEPTH = 128
MAX_PROPERTIES = 2_000
MAX_ENUM_VALUES = 5_000
MAX_GRAMMAR_RULES = 1_000
MAX_REPEAT = 10_000

# {n}, {n,} and {n,m}; more than 5 digits is over MAX_REPEAT without converting it.
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# A Lark rule or terminal definition at the start of a line, and a GBNF one anywhere.
_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)")
_GBNF_RULE = "::="


def _too_big(param: str, what: str, limit: int, unit: str = "") -> GrammarError:
    return GrammarError(param, f"'{param}' has more than {limit:,}{unit} {what}, the most "
                        "one output constraint may have")


def check_text(text: str, param: str, what: str = "characters") -> None:
    """A regular expression's or grammar's text: its size and its counted repetitions."""
    if len(text) > MAX_CHARS:
        raise _too_big(param, what, MAX_CHARS)
    for found in _REPEAT.finditer(text):
        for count in found.groups():
            if count and (len(count) > 5 or int(count) > MAX_REPEAT):
                raise GrammarError(param, f"'{param}' repeats {found.group(0)} times; a "
                                   f"counted repetition may be at most {MAX_REPEAT:,}")


def check_grammar(text: str, param: str) -> None:
    """A Lark or GBNF grammar: :func:`check_text` and its number of rules."""
    check_text(text, param)
    rules = text.count(_GBNF_RULE)
    if rules <= MAX_GRAMMAR_RULES:
        rules += sum(1 for _ in _LARK_RULE.finditer(text))
    if rules > MAX_GRAMMAR_RULES:
        raise _too_big(param, "rules", MAX_GRAMMAR_RULES)


def check_choices(options: list[str], param: str) -> None:
    if sum(len(o) for o in options) > MAX_CHARS:
        raise _too_big(param, "characters in all choices together", MAX_CHARS)


class _Walk:
    """One pass over a schema's JSON values (dicts and lists, as parsed), by an explicit
    stack (no recursion to exhaust), counting what the module docstring bounds."""

    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param
        self.nodes = self.chars = self.properties = self.enums = 0

    def count(self, value: dict[str, Any] | list[Any]) -> None:
        """Count ``value`` and its scalars (its containers are counted when visited)."""
        self.nodes += len(value) + 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise _too_big(self.param, "values", MAX_SCHEMA_NODES)
        items = value.values() if isinstance(value, dict) else value
        self.chars += sum(len(v) for v in items if isinstance(v, str))
        if isinstance(value, dict):
            self.chars += sum(len(k) for k in value)
            self._keywords(value)
        if self.chars > MAX_CHARS:
            raise _too_big(self.param, "characters in its strings", MAX_CHARS)

    def _keywords(self, value: dict[str, Any]) -> None:
        props = value.get("properties")
        if isinstance(props, dict):
            self.properties += len(props)
            if self.properties > MAX_PROPERTIES:
                raise _too_big(self.param, "properties", MAX_PROPERTIES)
        enum = value.get("enum")
        if isinstance(enum, list):
            self.enums += len(enum)
            if self.enums > MAX_ENUM_VALUES:
                raise _too_big(self.param, "enum values", MAX_ENUM_VALUES)
        if isinstance(value.get("pattern"), str):
            check_text(value["pattern"], self.param)
        if "$ref" in value:
            self._refuse_ref_cycle(value)

    def resolve(self, ref: Any) -> Any:
        """The value a local ``$ref`` ("#/$defs/a") points at, or None (remote, missing:
        the compiler says so)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def edges(self, value: Any) -> list[Any]:
        """The containers ``value`` holds, and the one its ``$ref`` points at."""
        items = value.values() if isinstance(value, dict) else value
        out = [v for v in items if isinstance(v, (dict, list))]
        if isinstance(value, dict) and "$ref" in value:
            target = self.resolve(value["$ref"])
            if isinstance(target, (dict, list)):
                out.append(target)
        return out

    def _refuse_ref_cycle(self, value: dict[str, Any]) -> None:
        seen = {id(value)}
        while isinstance(value, dict) and "$ref" in value:
            target = self.resolve(value["$ref"])
            if id(target) in seen:
                raise GrammarError(self.param, f"'{self.param}' has a $ref "
                                   f"({value['$ref']}) that leads back to itself through "
                                   "$ref alone, so no value satisfies it")
            if len(seen) > MAX_SCHEMA_DEPTH:
                raise _too_deep(self.param)
            seen.add(id(target))
            value = target


def _too_deep(param: str) -> GrammarError:
    return GrammarError(param, f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels, "
                        "counting each $ref it follows")


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema's size (values, characters, properties, enum values) and its depth,
    counting each nesting and each ``$ref`` followed; and a ``$ref`` cycle with nothing
    between (``a`` refers to ``b``, ``b`` to ``a``), which no value satisfies. A value
    reached again on its own path is a recursive schema (a tree): allowed, and no deeper."""
    if not isinstance(schema, (dict, list)):
        return
    walk = _Walk(schema, param)
    depth: dict[int, int] = {}  # id(value) -> the longest path below it, once known
    path: set[int] = set()  # the values being visited: the current one's ancestors
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        value, done = stack.pop()
        key = id(value)
        if done:  # its children are known, or on the path (not deeper)
            path.discard(key)
            depth[key] = 1 + max((depth.get(id(c), 0) for c in walk.edges(value)), default=0)
        elif key in depth:  # reached again by another way: as deep as it was
            if len(path) + depth[key] > MAX_SCHEMA_DEPTH:
                raise _too_deep(param)
        elif key not in path:
            if len(path) >= MAX_SCHEMA_DEPTH:
                raise _too_deep(param)
            walk.count(value)
            path.add(key)
            stack.append((value, True))
            stack.extend((c, False) for c in walk.edges(value))
