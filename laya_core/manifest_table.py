"""Reading one TOML table of the manifest: typed keys, their checks, and errors that name them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from laya_core import budget


class ManifestError(Exception):
    """A manifest problem; ``key`` is the path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


def parse_size(text: str | int, key: str, minimum: int = 1) -> int:
    """A size in whole bytes (:func:`laya_core.budget.parse_size`); errors name ``key``."""
    try:
        return budget.parse_size(text, minimum)
    except ValueError as e:
        raise ManifestError(key, str(e)) from None


class Table:
    """Reads typed keys from one TOML table and complains about the ones left over."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ManifestError(path, f"expected a table, got {type(data).__name__}")
        self.data = dict(data)
        self.path = path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None,
            required: bool = False, check: Callable[[Any], str | None] | None = None) -> Any:
        if name not in self.data:
            if required:
                raise ManifestError(self.key(name), "is required")
            return default
        value = self.data.pop(name)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ManifestError(self.key(name), f"expected {names}, got {value!r}")
        problem = check(value) if check else None
        if problem:
            raise ManifestError(self.key(name), problem)
        return value

    def int_in(self, name: str, low: int, high: int, default: int | None) -> Any:
        def check(v: int) -> str | None:
            return None if low <= v <= high else f"must be between {low} and {high}, got {v}"
        return self.get(name, int, default, check=check)

    def finish(self, known: tuple[str, ...]) -> None:
        for name in self.data:
            hint = f"; known keys: {', '.join(known)}" if known else ""
            raise ManifestError(self.key(name), f"unknown key{hint}")


def non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"
