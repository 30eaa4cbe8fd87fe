"""Schemathesis hooks for test_openapi_fuzz: hostile values spliced into generated bodies.

A generated JSON body only ever holds what Python's json writes, so it never carries the
shapes that broke the server: a lone surrogate escape, NaN, a number past a double or int64,
nesting past 64 levels. About one body in three gets one of them in a field of its own or
a known one, sent as raw bytes (schemathesis sends a bytes body as it is). Loaded through the
SCHEMATHESIS_HOOKS environment variable; the server must answer each with a 4xx that
conforms to the spec, never a 5xx.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from hypothesis import strategies as st

HOSTILE = (  # JSON text of one value each
    '"\\ud800"', '"ok \\udfff"', '[{"role": "user", "content": "a\\ud800"}]', '["\\udbff"]',
    "1" + "0" * 400, "1e400", "-1e400", "NaN", "-Infinity", "9" * 30, "[" + "9" * 30 + "]",
    "[" * 65 + "]" * 65, "[" * 10_000 + "]" * 10_000, '{"a": ' * 100 + "1" + "}" * 100,
)
FIELDS = ("messages", "prompt", "user", "temperature", "top_p", "top_k", "seed", "n",
          "max_tokens", "max_completion_tokens", "presence_penalty", "repetition_penalty",
          "stop", "tokens")
_MARK = "laya-fuzz-hostile-value"


def splice(body: dict[str, Any], field: str, value: str) -> bytes:
    """``body`` as JSON bytes with ``field`` set to the raw JSON text ``value``."""
    text = json.dumps({**body, field: _MARK})
    return text.replace(json.dumps(_MARK), value, 1).encode()


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    if not isinstance(body, dict):
        return st.just(body)
    hostile = st.builds(splice, st.just(body), st.sampled_from(sorted(body) + list(FIELDS)),
                        st.sampled_from(HOSTILE))
    return st.sampled_from((False, False, True)).flatmap(
        lambda spoil: hostile if spoil else st.just(body))
