"""Whether this machine can run the ExLlama libraries: an NVIDIA GPU, CUDA through torch, and
the library installed. Both libraries compile their CUDA kernels when first imported and fail
without CUDA, so ``laya check`` and ``laya serve`` ask this first and refuse with one plain
line, rather than a replica failing at load.

The driver's files say whether there is a GPU at all without importing anything; torch is
imported only where they exist (about a second), and the library is only looked up.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

# What NVIDIA's kernel driver creates: the first is there once the module is loaded, the
# second once a device node exists (containers often have only the nodes).
DRIVER_PATHS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0")


def cuda_problem(backend: str, package: str,
                 driver_paths: Sequence[str] = DRIVER_PATHS) -> str | None:
    """Why the ``backend`` backend (library ``package``) cannot run here, or None."""
    need = f"the {backend} backend needs an NVIDIA GPU with CUDA"
    if not any(os.path.exists(p) for p in driver_paths):
        return (f"{need}, and this machine has none (no NVIDIA driver: "
                f"{' and '.join(driver_paths)} are missing); serve the model on a machine "
                "with one (laya plan --gpus plans for one from here)")
    if importlib.util.find_spec("torch") is None:
        return f"{need} through torch, which is not installed: install a CUDA build of " \
               f"torch, then {package}"
    import torch

    if not torch.cuda.is_available():
        return (f"{need}: this machine has NVIDIA's driver, but torch {torch.__version__} "
                "finds no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides "
                "them)")
    if importlib.util.find_spec(package) is None:
        return f"the {backend} backend needs the {package} package, which is not " \
               f"installed: pip install {package} (a build for torch {torch.__version__})"
    return None
