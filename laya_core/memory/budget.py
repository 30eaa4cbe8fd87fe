"""How much memory a deployment may use: the manifest's budget, else what the machine allows.

Without a budget in the manifest, the limit is the cgroup's ``memory.max`` when one is set
(containers, systemd units), else ``MemAvailable`` from /proc/meminfo; a headroom is kept back
from either for the kernel, page cache and everything else on the machine.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import attrs

HEADROOM_FRACTION = 0.10
MIN_HEADROOM_BYTES = 256 * 2**20
MAX_SIZE = 2**60  # 1 EiB: a larger size is a typo
# Digits are bounded so that a 400-digit size is "not a size", not a number to compute with.
_SIZE_RE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,20})?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_UNITS = {
    None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else f"{shown[:36]}... ({len(shown)} characters)"


def parse_size(text: object, minimum: int = 1) -> int:
    """``"12GiB"``, ``"1.5 GiB"`` or a number of bytes, to whole bytes from ``minimum`` to
    1 EiB; a fraction of a byte is dropped. ValueError says what is wrong."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    elif isinstance(text, str) and (m := _SIZE_RE.match(text)):
        size = int(Fraction(m.group(1)) * _UNITS[m.group(2)])  # exact, where float rounds
    else:
        raise ValueError(f'expected a size such as "12GiB" or "512MiB" (at most 20 digits), '
                         f"got {_shown(text)}")
    if size > MAX_SIZE:
        raise ValueError(f"{_shown(text)} is more than 1 EiB (2**60 bytes)")
    if size < minimum:
        raise ValueError(f"{text!r} is {size} bytes; this size must be a whole number of at "
                         f"least {minimum} bytes")
    return size


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


def for_ram(total: int) -> Budget:
    """The budget of a machine with ``total`` bytes of RAM (``laya plan --ram``), less the
    headroom ``detect`` keeps."""
    headroom = max(MIN_HEADROOM_BYTES, int(total * HEADROOM_FRACTION))
    return Budget(max(0, total - headroom),
                  f"--ram {total / 2**30:.4g} GiB, less {HEADROOM_FRACTION:.0%} headroom", headroom)
