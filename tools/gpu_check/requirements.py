"""The Python requirements of a GPU check, one a line, for prepare_wheels.sh.

    python tools/gpu_check/requirements.py 3.12

Read from the tree: the core's and the torch and exl2 backends' dependencies, the C++
router's build requirements (pyproject.toml files), each marker evaluated for that Python
version; plus the openai client the battery drives. The tree's own distributions and the
GPU machine's torch are left out; exllamav2 is fetched apart (its declared dependencies
are for its server and its parquet datasets, none of which this check uses).
"""

from __future__ import annotations

import sys
import tomllib

import common
from packaging.requirements import Requirement

FOLDERS = ("", "plugins/backend_torch", "plugins/backend_exl2")
BATTERY = ("openai>=1.40",)  # pyproject.toml's test extra asks the same
LEFT_OUT = {"laya-core", "torch"}


def requirements(python_version: str) -> list[str]:
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_machine": "x86_64"}
    lines: list[str] = []
    for folder in FOLDERS:
        path = common.REPO / folder / "pyproject.toml"
        if path.is_file():
            lines += tomllib.loads(path.read_text())["project"].get("dependencies", [])
    router = common.REPO / "plugins" / "router_nanobind" / "pyproject.toml"
    lines += tomllib.loads(router.read_text())["build-system"]["requires"]
    lines += BATTERY
    chosen: dict[str, str] = {}
    for line in lines:
        req = Requirement(line)
        if req.name in LEFT_OUT or (req.marker and not req.marker.evaluate(env)):
            continue
        req.marker = None
        chosen.setdefault(req.name.lower(), str(req))
    return sorted(chosen.values())


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "3.12")))
