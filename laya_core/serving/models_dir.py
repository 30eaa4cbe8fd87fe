"""The watcher of a ``[models_dir]`` (``laya serve --models-dir DIR``): every few seconds it
looks for models copied into the folder and serves each, on demand, without a restart.

A new file is taken once its size is the same on two looks in a row (a copy under way is
left until it is done). Its entry (the table's keys, laya_core/config/models_dir.py) is
checked as a manifest entry is and planned: a file that is not a model, or a model that
cannot fit beside the pinned ones, is logged once with the reason and left out; the rest
are added to the deployment (Deployment.add_model), unloaded, and load at their first
request. A file removed while serving stays served until the server stops (its replicas
may hold it open or mapped).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from laya_core.config import manifest as mf
from laya_core.config.models_dir import ModelsDir, found
from laya_core.logs import start_named
from laya_core.memory import planner
from laya_core.plugins import Registry
from laya_core.serving.deployment import Deployment
from laya_core.units import fmt_bytes

log = logging.getLogger(__name__)

LOOK_EVERY_S = 2.0


class ModelsDirWatcher:
    """Adds the models copied into ``models_dir`` to ``deployment``; see the module
    docstring. :meth:`look` does one pass (the thread calls it every ``interval_s``)."""

    def __init__(self, deployment: Deployment, models_dir: ModelsDir, registry: Registry,
                 interval_s: float = LOOK_EVERY_S) -> None:
        self.deployment = deployment
        self.models_dir = models_dir
        self.registry = registry
        self.interval_s = interval_s
        self._sizes: dict[str, int] = {}  # path -> its size at the last look
        self._refused: set[str] = set()  # paths said once as not servable
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="laya-models-dir")

    def start(self) -> None:
        start_named(self._thread, "laya-models-dir")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception:  # noqa: BLE001 - the next look tries again
                log.exception("looking in %s failed", self.models_dir.path)

    def look(self) -> list[str]:
        """Add the models that appeared and have stopped growing; their names."""
        added = []
        for name, path in found(Path(self.models_dir.path)).items():
            if name in self.deployment.models or path in self._refused:
                continue
            size = _size(path)
            if self._sizes.get(path) != size:  # new, or still being copied
                self._sizes[path] = size
                continue
            if self._add(name, path):
                added.append(name)
        return added

    def _add(self, name: str, path: str) -> bool:
        d = self.deployment
        try:
            config = mf.resolve(mf.from_dict({"models": [self.models_dir.entry(name, path)]}),
                                self.registry).models[0]
            plan = planner.plan_added(d.plan, config, self.registry) if d.plan else None
        except mf.ManifestError as e:
            self._refuse(path, "; ".join(message for _, message in e.problems))
            return False
        except ValueError as e:
            self._refuse(path, str(e))
            return False
        if plan is not None:
            config = next(r.config for r in plan.replicas if r.model == name)
            need = plan.model_bytes(name)
            room = plan.budget.bytes - d.residency.fixed_bytes
            if need > room:
                self._refuse(path, f"it needs {fmt_bytes(need)} by the plan, and "
                             f"{fmt_bytes(room)} of the {fmt_bytes(plan.budget.bytes)} budget "
                             "is left beside the runtime and the pinned models; give it a "
                             "smaller max_seq_len or max_num_seqs in [models_dir]")
                return False
        d.add_model(config, plan)
        log.info("serving %s (%s) from %s, loaded on demand", name, path,
                 self.models_dir.path)
        return True

    def _refuse(self, path: str, why: str) -> None:
        self._refused.add(path)
        log.error("not serving %s from %s: %s", path, self.models_dir.path, why)


def _size(path: str) -> int:
    """A file's size, or a folder's files' sizes together."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total
