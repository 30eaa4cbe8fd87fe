"""The torch backend's ``[models.options]``: their checks, and what "auto" becomes.

``dtype = "auto"`` picks what the hardware computes fast: bfloat16 on a CUDA device that
has it (float16 otherwise), and on a CPU bfloat16 only where the CPU has native bf16
instructions (AVX512-BF16 or AMX). Elsewhere bfloat16 is emulated and can be slower than
float32, so float32 it is.

``quantize = "auto"`` keeps a quantized file's weights quantized on a CPU, where decoding is
bound by reading them: a Q4_0/Q4_1 GGUF's layers in int4 (a Q4_1 file's exactly as stored),
a Q8_0 file's in int8; float checkpoints stay dense. Dequantizing the embedded Q4_1 model to
bfloat16 read 3.5 times the bytes a token and decoded at 23 tokens/s against int4's 58 (one
thread, AMD EPYC); with the kernels of an AVX2 CPU (``ATEN_CPU_CAPABILITY=avx2``) int4's
layer products took 13.6 ms a token, where float32, that CPU's dtype, reads 424 MB of them.
Not on CUDA (no int4 kernel there) and not where the manifest asks for ``dtype =
"float32"``, whose products the integer kernels, computing in bfloat16, would not be.
Nothing here imports torch at manifest-check time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from laya_core.engine.threads import physical_cores

OPTIONS: dict[str, str] = {
    "device": '"cpu" or "cuda" (or "cuda:N")',
    "dtype": '"auto", "float32", "bfloat16" or "float16"',
    "quantize": '"auto", "none", "int8" or "int4"',
    "n_threads": '"auto" or a whole number from 1 to 1024',
    "compile": "true or false",
    "deterministic": "true or false",
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
# quantize = "int4": a scale and a zero per this many inputs of a row (GGUF's Q4_1 block).
INT4_GROUP = 32


def check(name: str, value: object) -> str | None:
    """A problem with option ``name``'s value, or None."""
    ok = {
        "device": isinstance(value, str) and (value == "cpu" or value == "cuda" or (
            value.startswith("cuda:") and value[5:].isdigit())),
        "dtype": value in _DTYPES,
        "quantize": value in ("auto", "none", "int8", "int4"),
        "n_threads": value == "auto" or (type(value) is int and 1 <= value <= 1024),
        "compile": isinstance(value, bool),
        "deterministic": isinstance(value, bool),
    }[name]
    return None if ok else f"must be {OPTIONS[name]}, not {value!r}"


def check_together(opts: dict[str, Any]) -> dict[str, str]:
    """Values fine alone that the chosen device cannot run."""
    device, problems = opts.get("device", "cpu"), dict[str, str]()
    if opts.get("dtype") == "float16" and not device.startswith("cuda"):
        problems["dtype"] = ('"float16" runs on cuda only (a CPU emulates it, slowly); use '
                             '"bfloat16" or "float32" on a CPU')
    if opts.get("quantize") == "int4" and device != "cpu":
        problems["quantize"] = ('"int4" runs on the cpu only (torch\'s int4 kernel there); '
                                'use "int8" or "none" on cuda')
    return problems


def check_path(path: str) -> str | None:
    """A GGUF file, or a Hugging Face folder with config.json and safetensors."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            return f"{path} is a folder without config.json; the torch backend loads a " \
                   "Hugging Face model folder (config.json, *.safetensors) or a .gguf file"
        if not any(p.glob("*.safetensors")):
            return f"{path} has no .safetensors weights (pickled .bin checkpoints are not " \
                   "loaded: they can run code)"
        if (method := _quant_method(p)) in ("exl2", "exl3"):
            return f"{path} is an {method.upper()} folder, which only exllama runs: backend " \
                   f'= "{method}" (an NVIDIA GPU with CUDA)'
        return None
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    return None if magic == b"GGUF" else f"{path} is neither a GGUF file nor a model folder"


def _quant_method(folder: Path) -> str | None:
    """``config.json``'s ``quantization_config.quant_method``, lower case; "exl2" for an
    EXL2 folder converted without it (its first safetensors header names ``*.q_weight``
    tensors); None: neither."""
    import json
    import struct

    try:
        qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(qc, dict):
        return str(qc.get("quant_method", "")).lower()
    try:
        with min(folder.glob("*.safetensors")).open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = json.loads(f.read(min(n, 100_000_000))) if n < 100_000_000 else {}
    except (OSError, ValueError, struct.error):
        return None
    return "exl2" if any(str(k).endswith(".q_weight") for k in names) else None


@attrs.frozen
class Chosen:
    device: str
    dtype: str  # a torch dtype's name
    reason: str  # why that dtype, for the start-up log and /ready
    quantize: str
    quantize_reason: str  # why that quantization, for /ready
    threads: int  # "auto": the physical cores, and a governor lowers it under contention
    auto_threads: bool
    compile: bool
    # Attention in float64: a sequence's logits the same bits in any batch and chunking.
    deterministic: bool


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def quantization(opts: dict[str, Any], stored: str) -> tuple[str, str]:
    """(the ``quantize`` a replica runs with, why), for a file whose layers are stored as
    ``stored`` (``Checkpoint.quantization``)."""
    asked = opts.get("quantize", "auto")
    if asked != "auto":
        return asked, "set in the manifest"
    if opts.get("device", "cpu") != "cpu":
        return "none", "auto: dense on a GPU"
    if opts.get("dtype") == "float32":
        return "none", 'auto: dtype = "float32" asks for float32 products'
    if stored == "none":
        return "none", "auto: the checkpoint's weights are not quantized"
    return stored, f"auto: the file's layers are stored in {stored[3:]} bits"


def choose(opts: dict[str, Any], stored: str = "none") -> Chosen:
    """The settings a replica runs with, for a file whose layers are stored as ``stored``
    (imports torch: call at load)."""
    import torch

    device = opts.get("device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f'device "{device}" was asked for, but torch sees no CUDA device '
                           f"(torch {torch.__version__})")
    dtype, reason = opts.get("dtype", "auto"), "set in the manifest"
    if dtype == "auto":
        if device.startswith("cuda"):
            bf16 = torch.cuda.is_bf16_supported()
            dtype = "bfloat16" if bf16 else "float16"
            reason = "auto: the GPU " + ("has bfloat16" if bf16 else "lacks bfloat16")
        elif native_bf16():
            dtype, reason = "bfloat16", "auto: the CPU has native bf16 (AVX512-BF16 or AMX)"
        else:
            dtype, reason = "float32", "auto: the CPU has no native bf16, where it is slower"
    if problems := check_together(opts):  # a manifest's check said so already
        raise RuntimeError("; ".join(f"{name}: {why}" for name, why in problems.items()))
    quantize, quantize_reason = quantization(opts, stored)
    threads = opts.get("n_threads", "auto")
    auto = threads == "auto"
    return Chosen(device, dtype, reason, quantize, quantize_reason,
                  physical_cores() if auto else int(threads), auto,
                  bool(opts.get("compile", False)), bool(opts.get("deterministic", False)))
