"""How much memory a deployment may use: the manifest's budget, else what the machine allows.

Without a budget in the manifest, the limit is the cgroup's ``memory.max`` when one is set
(containers, systemd units), else ``MemAvailable`` from /proc/meminfo; a headroom is kept back
from either for the kernel, page cache and everything else on the machine.
"""

from __future__ import annotations

from pathlib import Path

import attrs

HEADROOM_FRACTION = 0.10
MIN_HEADROOM_BYTES = 256 * 2**20


@attrs.frozen
class Budget:
    bytes: int  # what the plan may use, headroom already taken off
    source: str
    headroom_bytes: int = 0


def _cgroup_limit(root: Path) -> tuple[int, str] | None:
    for rel in ("memory.max", "memory/memory.limit_in_bytes"):
        path = root / rel
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        # "max" (v2) or a near-2^63 number (v1) means no limit.
        if text != "max" and text.isdigit() and int(text) < 2**60:
            return int(text), f"cgroup limit {path}"
    return None


def _mem_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def detect(configured: int | None, cgroup_root: Path = Path("/sys/fs/cgroup"),
           meminfo: Path = Path("/proc/meminfo")) -> Budget:
    """The budget in force: configured bytes as given, else the machine's limit less headroom."""
    if configured is not None:
        return Budget(configured, "manifest [memory] budget")
    limit = _cgroup_limit(cgroup_root)
    total, source = limit if limit else (_mem_available(meminfo), "MemAvailable (/proc/meminfo)")
    headroom = max(MIN_HEADROOM_BYTES, int(total * HEADROOM_FRACTION))
    return Budget(max(0, total - headroom), f"{source}, less {HEADROOM_FRACTION:.0%} headroom",
                  headroom)
