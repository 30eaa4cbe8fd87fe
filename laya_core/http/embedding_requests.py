"""Parsing and validating a ``POST /v1/embeddings`` body into an :class:`EmbeddingRequest`.

As for the completion endpoints, everything the body alone can tell is checked before any
work starts, and a problem names its field (``input``, ``input[2]``). What needs the model
(the vocabulary, the length limit) is checked by the handler, with the same field names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from laya_core.http.errors import invalid

# OpenAI's own limit on the inputs of one request.
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


@attrs.frozen
class EmbeddingRequest:
    model: str
    # Each input: text, or token ids; ``single`` when ``input`` was one, not an array.
    inputs: tuple[str | tuple[int, ...], ...]
    single: bool
    encoding_format: str = "float"
    user: str | None = None

    def param(self, index: int) -> str:
        """The field that input ``index`` came from, for errors about it."""
        return "input" if self.single else f"input[{index}]"


def _kind(value: object) -> str:
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise invalid(param, f"'{param}' is an empty array of token ids; send at least one",
                      "empty_input")
    for j, t in enumerate(value):
        if not _is_token(t):
            raise invalid(f"{param}[{j}]", f"'{param}[{j}]' must be a token id (an integer), "
                          f"got {_kind(t)}", "invalid_type")
        if t < 0:
            raise invalid(f"{param}[{j}]", f"'{param}[{j}]' is {t}: token ids are 0 or more")
    return tuple(value)


def _text(value: str, param: str) -> str:
    if not value:
        raise invalid(param, f"'{param}' is an empty string; send text to embed", "empty_input")
    return value


def _inputs(value: object) -> tuple[tuple[str | tuple[int, ...], ...], bool]:
    """The inputs of ``input``, and whether it was a single one (OpenAI's four shapes: a
    string, an array of strings, an array of token ids, an array of such arrays)."""
    if isinstance(value, str):
        return (_text(value, "input"),), True
    if not isinstance(value, list):
        raise invalid("input", "'input' must be a string, an array of strings, an array of "
                      f"token ids or an array of token-id arrays, got {_kind(value)}",
                      "invalid_type")
    if not value:
        raise invalid("input", "'input' is an empty array; send at least one input",
                      "empty_input")
    if _is_token(value[0]):  # an array of token ids, whatever else it holds
        return (_token_ids(value, "input"),), True
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} "
                      "go in one request")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if isinstance(item, str):
            out.append(_text(item, param))
        elif isinstance(item, list):
            out.append(_token_ids(item, param))
        else:
            raise invalid(param, f"'{param}' must be a string or an array of token ids, got "
                          f"{_kind(item)} (an array of token ids cannot mix in other values)",
                          "invalid_type")
    return tuple(out), False


def parse_embedding(body: Any) -> EmbeddingRequest:
    """The typed request, or an :class:`~laya_core.http.errors.APIError` naming the field."""
    if not isinstance(body, Mapping):
        raise invalid("body", "the request body must be a JSON object", "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required: a model name from GET /v1/models",
                      "missing" if model is None else "invalid_type")
    if "input" not in body:
        raise invalid("input", "'input' is required", "missing")
    inputs, single = _inputs(body["input"])
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODING_FORMATS:
        raise invalid("encoding_format", f"'encoding_format' must be \"float\" or \"base64\", "
                      f"got {fmt!r}" if isinstance(fmt, str) else
                      f"'encoding_format' must be a string, got {_kind(fmt)}")
    if body.get("dimensions") is not None:
        raise invalid("dimensions", "'dimensions' is not supported: Laya returns the model's "
                      "own embedding size (its hidden size) and cannot shorten it; leave "
                      "'dimensions' out", "unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"'user' must be a string, got {_kind(user)}", "invalid_type")
    return EmbeddingRequest(model, inputs, single, str(fmt), user)
