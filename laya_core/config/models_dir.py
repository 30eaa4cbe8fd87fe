"""A folder of models served on demand: the manifest's ``[models_dir]`` table, and
``laya serve --models-dir DIR``.

Every GGUF file (``*.gguf``) and model folder (one holding ``config.json``) directly in the
folder becomes a model loaded on demand (``load = "on_demand"``), named after the file
without ``.gguf`` or after the folder, with the table's other keys (any ``[[models]]`` key
but ``name``, ``path`` and ``load``) as its entry's. A ``[[models]]`` entry of the same name
wins. The serving side looks again every few seconds (laya_core/serving/models_dir.py), so
a model copied in later is served without a restart: a file is taken once its size has
stopped changing between two looks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from laya_core.config.sources import model_name_for
from laya_core.config.table import Problems, Table

# The [models_dir] keys besides the [[models]] ones its entries take.
OWN_KEYS = ("path",)
# [[models]] keys a models_dir entry cannot set: each file gives its own.
NOT_TEMPLATE = ("name", "path", "load")


@attrs.frozen
class ModelsDir:
    """A validated ``[models_dir]``: the folder, and what each of its entries holds."""

    path: str
    template: Mapping[str, Any] = attrs.field(factory=dict)

    def entries(self, taken: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """A ``[[models]]`` table per model in the folder now, by name, except ``taken``
        names."""
        return [self.entry(name, path) for name, path in found(Path(self.path)).items()
                if name not in taken]

    def entry(self, name: str, path: str) -> dict[str, Any]:
        return {**self.template, "name": name, "path": path, "load": "on_demand"}


def found(folder: Path) -> dict[str, str]:
    """The models directly in ``folder``, name to absolute path, in name order; hidden files
    are left out, and of two with one name the first in path order is kept."""
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return {}
    out: dict[str, str] = {}
    for child in children:
        if child.name.startswith("."):
            continue
        model = (child.suffix.lower() == ".gguf" and child.is_file()) \
            or (child.is_dir() and (child / "config.json").is_file())
        if model:
            out.setdefault(model_name_for(str(child)), str(child.absolute()))
    return dict(sorted(out.items()))


def parse(data: Any, base_dir: Path, problems: Problems, model_keys: tuple[str, ...],
          check_entry: Any) -> ModelsDir | None:
    """The ``[models_dir]`` table; ``check_entry(entry, problems)`` validates one model entry
    as ``[[models]]`` does (its problems come back under ``models_dir.``)."""
    t = Table(data, "models_dir", problems)
    path = t.get("path", str, required=True)
    allowed = tuple(k for k in model_keys if k not in NOT_TEMPLATE)
    template = {k: v for k, v in (data.items() if isinstance(data, Mapping) else ())
                if k in allowed}
    for key in template:  # each entry's check reads them
        t.data.pop(key)
    t.finish((*OWN_KEYS, *allowed))
    if path is None:
        return None
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else base_dir / folder
    if not folder.is_dir():
        t.problem("path", f"{folder} is not a folder; give the folder that holds the models "
                  "(GGUF files, model folders)")
        return None
    entry_problems = Problems()
    check_entry({**template, "name": "models-dir-entry", "path": str(folder), "load":
                 "on_demand"}, entry_problems)
    for key, message in entry_problems.found:
        problems.add("models_dir." + key.split(".", 1)[-1], message)
    if entry_problems.found:  # said once here, not again for each file
        return None
    return ModelsDir(str(folder.absolute()), template)
