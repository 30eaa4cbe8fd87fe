"""Reading one TOML table of the manifest: typed keys, their checks, and errors that name them.

A manifest is read whole before any problem is raised: each problem is recorded in a
:class:`Problems` and the reader goes on with the key's default, so ``laya check`` reports
every mistake of a file in one run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from laya_core.memory import budget


class ManifestError(Exception):
    """One or more manifest problems. ``key`` and ``message`` are the first one's (the path of
    the offending key and what is wrong); ``problems`` holds every ``(key, message)``."""

    def __init__(self, key: str, message: str,
                 more: Sequence[tuple[str, str]] = ()) -> None:
        self.problems: tuple[tuple[str, str], ...] = ((key, message), *more)
        super().__init__("\n".join(f"{k}: {m}" if k else m for k, m in self.problems))
        self.key = key
        self.message = message


class Problems:
    """The problems found so far while reading a manifest."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def add(self, key: str, message: str) -> None:
        if (key, message) not in self.found:
            self.found.append((key, message))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Record a :class:`ManifestError` raised inside instead of letting it out."""
        try:
            yield
        except ManifestError as e:
            for key, message in e.problems:
                self.add(key, message)

    def raise_if_any(self) -> None:
        if self.found:
            (key, message), *more = self.found
            raise ManifestError(key, message, more)


def parse_size(text: str | int, key: str, minimum: int = 1) -> int:
    """A size in whole bytes (:func:`laya_core.memory.budget.parse_size`); errors name ``key``."""
    try:
        return budget.parse_size(text, minimum)
    except ValueError as e:
        raise ManifestError(key, str(e)) from None


class Table:
    """Reads typed keys from one TOML table and complains about the ones left over."""

    def __init__(self, data: Any, path: str, problems: Problems) -> None:
        if not isinstance(data, Mapping):
            raise ManifestError(path, f"expected a table, got {type(data).__name__}")
        self.data = dict(data)
        self.path = path
        self.problems = problems

    def problem(self, name: str, message: str) -> None:
        """Record a problem of key ``name`` of this table."""
        self.problems.add(self.key(name), message)

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None,
            required: bool = False, check: Callable[[Any], str | None] | None = None) -> Any:
        """The key's value, or ``default`` when it is absent or wrong (the problem recorded)."""
        if name not in self.data:
            if required:
                self.problem(name, "is required")
            return default
        value = self.data.pop(name)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.problem(name, f"expected {names}, got {value!r}")
            return default
        problem = check(value) if check else None
        if problem:
            self.problem(name, problem)
            return default
        return value

    def int_in(self, name: str, low: int, high: int, default: int | None) -> Any:
        def check(v: int) -> str | None:
            return None if low <= v <= high else f"must be between {low} and {high}, got {v}"
        return self.get(name, int, default, check=check)

    def finish(self, known: tuple[str, ...]) -> None:
        """Record every key left unread as unknown."""
        for name in self.data:
            hint = f"; known keys: {', '.join(known)}" if known else ""
            self.problem(name, f"unknown key{hint}")


def non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"
