"""JSON schemas that stress a constraint compiler, shared by the unit and the served tests
of the constraint limits (a chain of ``$ref``s, and nesting through ``$ref``)."""

from __future__ import annotations

from typing import Any


def ref_chain(n: int) -> dict[str, Any]:
    """``$ref`` to ``$ref`` ... ``n`` times, then a string."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_nesting(n: int) -> dict[str, Any]:
    """Objects nested ``n`` deep, each level through a ``$ref``."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "required": ["x"], "properties": {
        "x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}
