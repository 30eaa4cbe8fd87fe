"""The GPUs a plan may place memory on, and each one's budget.

A replica's ledger places every line on a device: "cpu" (the host's RAM, whose budget
``budget.detect`` reads) or a GPU named as torch and CUDA number them ("cuda:0"). Each GPU's
budget is, in order of precedence:

- ``[memory] gpu_budget``: one size for every GPU, or a table of sizes by device;
- what ``laya plan --gpus 24GiB,24GiB`` says a machine has (planning for another machine),
  less a headroom;
- what this machine's driver reports free (NVML, the driver's own library, through ctypes:
  the core imports no GPU library), less a headroom.

A machine without NVIDIA's driver has no GPUs, and finding that out imports nothing.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping

import attrs

from laya_core.memory.budget import Budget, parse_size

HOST = "cpu"
# Kept back from each GPU: the CUDA caching allocator's fragmentation and whatever else the
# device runs (a desktop's display takes 0.3-1 GiB of a workstation card).
GPU_HEADROOM_FRACTION = 0.05
MIN_GPU_HEADROOM_BYTES = 256 * 2**20
# What a process's CUDA context takes on each GPU it uses, before any tensor: the driver's
# state and the kernels of the libraries it loads (cuBLAS, the backend's own). An estimate
# (0.3-0.6 GiB is commonly reported for recent drivers), not yet measured on a GPU of this
# project's: tools/gpu_check.sh prints the measured one.
CUDA_CONTEXT_BYTES = 512 * 2**20
_DEVICE_RE = re.compile(r"^cuda:(\d{1,3})$")
_MANY_RE = re.compile(r"^\s*(\d{1,2})\s*x\s*(.+)$")


def is_gpu(device: str) -> bool:
    return _DEVICE_RE.match(device) is not None


def gpu_name(index: int) -> str:
    return f"cuda:{index}"


def device_index(device: str) -> int:
    """The number of a GPU's name ("cuda:1" -> 1; "cuda" is the first)."""
    if device == "cuda":
        return 0
    m = _DEVICE_RE.match(device)
    if m is None:
        raise ValueError(f"{device!r} is not a GPU's name (cuda:N)")
    return int(m.group(1))


@attrs.frozen
class Gpus:
    """The GPUs a plan is made for, each with its budget."""

    budgets: Mapping[str, Budget] = attrs.field(factory=dict)
    # Found on this machine (their libraries' builds matter: a backend built without GPU
    # support cannot use them), rather than said of another machine (``--gpus``).
    local: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.budgets, key=device_index))

    def budget_bytes(self, device: str) -> int:
        b = self.budgets.get(device)
        return 0 if b is None else b.bytes

    @property
    def machine(self) -> str:
        """The machine these GPUs are on, as an error names it."""
        return "this machine" if self.local else "the machine planned for (--gpus)"

    @property
    def elsewhere(self) -> str:
        """The way out of a refusal here: planning for another machine (none where these
        GPUs are another machine's already)."""
        return ", or plan for another machine with laya plan --gpus" if self.local else ""


NO_GPUS = Gpus()


def _less_headroom(total: int, source: str) -> Budget:
    headroom = max(MIN_GPU_HEADROOM_BYTES, int(total * GPU_HEADROOM_FRACTION))
    return Budget(max(0, total - headroom),
                  f"{source}, less {GPU_HEADROOM_FRACTION:.0%} headroom", headroom)


def parse_gpus(text: str) -> tuple[int, ...]:
    """``--gpus``: each GPU's memory, comma-separated ("24GiB", "24GiB,12GiB", "2x80GiB");
    "none" or "0" for a machine without one. ValueError says what is wrong."""
    text = text.strip()
    if text in ("none", "0", ""):
        return ()
    sizes: list[int] = []
    for part in text.split(","):
        m = _MANY_RE.match(part)
        count, size = (int(m.group(1)), m.group(2)) if m else (1, part)
        if not 1 <= count <= 16:
            raise ValueError(f"{part.strip()!r}: from 1 to 16 GPUs of a size")
        sizes += [parse_size(size.strip(), minimum=2**20)] * count
    if len(sizes) > 16:
        raise ValueError(f"{len(sizes)} GPUs: at most 16")
    return tuple(sizes)


def given(sizes: tuple[int, ...]) -> Gpus:
    """The GPUs of another machine, as ``--gpus`` gives their sizes."""
    return Gpus({gpu_name(i): _less_headroom(s, f"--gpus: {s / 2**30:.4g} GiB")
                 for i, s in enumerate(sizes)}, local=False)


def _driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/gpus") or os.path.exists("/dev/nvidia0")


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def _free_by_nvml() -> list[int] | None:
    """Each GPU's free bytes in NVML's order, from the driver's own library (shipped with
    it) through ctypes: the front end of a llama.cpp deployment does not grow by libtorch to
    read a number. None: NVML failed (no GPU then)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        free = []
        for i in range(count.value):
            handle, memory = ctypes.c_void_p(), _NvmlMemory()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0):
                return None
            free.append(int(memory.free))
        return free
    finally:
        nvml.nvmlShutdown()


def visible(free: list[int], setting: str | None) -> list[int] | None:
    """The GPUs CUDA numbers cuda:0, cuda:1 ... under ``CUDA_VISIBLE_DEVICES`` (``setting``;
    None: all, in NVML's order, which is CUDA's where ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), from
    NVML's list; None where the setting names them otherwise (UUIDs, MIG instances). CUDA
    stops at the first entry that is not a GPU."""
    if setting is None:
        return free
    if not setting.strip():
        return []  # none visible
    out = []
    for entry in setting.split(","):
        entry = entry.strip()
        if not entry.lstrip("-").isdigit():
            return None
        index = int(entry)
        if not 0 <= index < len(free):
            break
        out.append(free[index])
    return out


def detect() -> Gpus:
    """This machine's GPUs with their free memory, less headroom; none without a driver."""
    if not _driver_present():
        return NO_GPUS
    nvml = _free_by_nvml()
    if nvml is None:
        return NO_GPUS
    source = "free memory (NVML)"
    free = visible(nvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if free is None:
        free, source = nvml, ("free memory (NVML; CUDA_VISIBLE_DEVICES names GPUs otherwise "
                              "than by number, so all are planned: set [memory] gpu_budget)")
    elif len(free) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        # CUDA numbers GPUs fastest first by default, NVML by bus: alike for GPUs of one kind.
        source = ("free memory (NVML, in bus order; CUDA_DEVICE_ORDER=PCI_BUS_ID makes "
                  "CUDA's numbers the same)")
    return Gpus({gpu_name(i): _less_headroom(f, source) for i, f in enumerate(free)})


def with_configured(gpus: Gpus, configured: int | Mapping[str, int] | None) -> Gpus:
    """``gpus`` with ``[memory] gpu_budget`` in force: a size for every GPU, or by device.
    A budget larger than what the device has left is kept as configured: the manifest's
    author may know better (memory another process is about to free), and a wrong guess is
    the CUDA allocator's error at load."""
    if configured is None:
        return gpus
    if isinstance(configured, int):
        by_device = {d: configured for d in gpus.budgets}
    else:
        by_device = {d: size for d, size in configured.items() if d in gpus.budgets}
    return attrs.evolve(gpus, budgets={
        d: Budget(by_device[d], "manifest [memory] gpu_budget") if d in by_device else b
        for d, b in gpus.budgets.items()})


def check_device_name(text: str) -> str | None:
    """A problem with a GPU's name in the manifest, or None."""
    return None if _DEVICE_RE.match(text) else f'{text!r} is not a GPU\'s name ("cuda:0")'
