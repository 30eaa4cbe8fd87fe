"""The llama.cpp backend's GPU options: their checks, how the plan places them on the GPUs it
has (``Backend.place``), and what this machine's GPUs and build refuse
(``Backend.check_devices``). What the offloaded layers cost is memory.py's."""

from __future__ import annotations

import attrs

from laya_backend_llamacpp import loading
from laya_backend_llamacpp.memory import MAX_GPUS, SPLIT_MODES
from laya_core.backend import ModelConfig
from laya_core.memory.devices import Gpus
from laya_core.models.files import ModelShape

OPTIONS = frozenset({"n_gpu_layers", "split_mode", "tensor_split", "main_gpu"})


def check_option(name: str, value: object) -> str | None:
    """A problem with GPU option ``name``'s value, or None."""
    if name == "n_gpu_layers":
        ok = value == "auto" or (type(value) is int and 0 <= value <= 100_000)
        return None if ok else f'must be "auto" or a whole number of layers, 0 or more, ' \
            f"not {value!r}"
    if name == "split_mode":
        return None if value in SPLIT_MODES else \
            f"must be one of {', '.join(SPLIT_MODES)}, not {value!r}"
    if name == "main_gpu":
        ok = type(value) is int and 0 <= value < MAX_GPUS
        return None if ok else f"must be a GPU's number from 0 to {MAX_GPUS - 1}, " \
            f"not {value!r}"
    if name == "tensor_split":
        ok = (isinstance(value, list) and 1 <= len(value) <= MAX_GPUS
              and all(type(x) in (int, float) and 0 <= x < 1e6 for x in value)
              and sum(value) > 0)
        return None if ok else f"must be a list of 1 to {MAX_GPUS} shares, one " \
            f"per GPU (numbers, 0 or more, not all 0), not {value!r}"
    return None


def _offloads(gpus: Gpus) -> bool:
    """Whether layers can go to ``gpus``: said of another machine (``laya plan --gpus``),
    yes; on this one, where the installed llama.cpp was built with GPU support."""
    return not gpus.local or bool(loading.llama().llama_supports_gpu_offload())


def place(config: ModelConfig, shape: ModelShape, gpus: Gpus) -> tuple[ModelConfig, int]:
    """``tensor_split`` from the budgets where several GPUs split the layers and the
    manifest gives none; and every layer and the head as the most "auto" may offload."""
    limit = shape.n_layers + 1 if gpus.budgets and _offloads(gpus) else 0
    names = gpus.names
    if (len(names) > 1 and "tensor_split" not in config.options
            and config.options.get("split_mode", "layer") != "none"):
        # llama.cpp splits by each GPU's free memory; the plan, by each one's budget.
        shares = [round(gpus.budget_bytes(d) / 2**30, 3) for d in names]
        config = attrs.evolve(config, options={**config.options, "tensor_split": shares})
    return config, limit


def check_devices(config: ModelConfig, gpus: Gpus) -> dict[str, str]:
    """A number of layers where the machine has no GPU or this build cannot offload, or a
    GPU it lacks; on this machine or the one planned for (``gpus.local``)."""
    layers = config.options.get("n_gpu_layers", "auto")
    if type(layers) is int and layers > 0:  # asked for: refused where it cannot be
        if not gpus.budgets:
            found = " (no NVIDIA driver found)" if gpus.local else ""
            return {"options.n_gpu_layers": f"{layers} layers on a GPU, but {gpus.machine} "
                    f"has none{found}; remove it (\"auto\" offloads what fits where there "
                    f"is a GPU){gpus.elsewhere}"}
        if not _offloads(gpus):
            return {"options.n_gpu_layers": f"{layers} layers on a GPU, but this "
                    "llama-cpp-python was built without GPU support; rebuild it with "
                    "CUDA (make install GPU=cuda)"}
    if not gpus.budgets:
        return {}
    problems = {}
    have = f"{gpus.machine} has {len(gpus.names)} GPU(s) ({', '.join(gpus.names)})"
    main = config.options.get("main_gpu", 0)
    if main >= len(gpus.names):
        problems["options.main_gpu"] = f"GPU {main}, but {have}; name one of them" \
            + gpus.elsewhere
    shares = config.options.get("tensor_split") or ()
    if len(shares) > len(gpus.names):
        problems["options.tensor_split"] = (f"{len(shares)} shares, but {have}; give one "
                                            "share per GPU")
    return problems
