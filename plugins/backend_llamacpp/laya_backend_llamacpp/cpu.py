"""What the CPU and the llama.cpp build offer, and the choices that follow from it.

Pure functions of ``/proc/cpuinfo``, the CPU topology in ``/sys`` and the build's
``llama_print_system_info()`` text, so that each decision can be tested with any CPU's facts.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from laya_core.engine.threads import physical_cores  # noqa: F401 - cpu.physical_cores, as before

# CPU flags worth naming in the start-up log and /ready, in this order (x86 names in
# /proc/cpuinfo; other architectures simply show fewer).
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                 "amx_int8", "amx_bf16", "neon", "sve")


@attrs.frozen
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def notable_flags(self) -> list[str]:
        return [f for f in NOTABLE_FLAGS if f in self.flags]


def read_cpuinfo(text: str | None = None) -> CpuInfo:
    """The first processor's model name and flags (all cores of one machine agree)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model or "unknown CPU", flags)


def build_features(system_info: str) -> frozenset[str]:
    """The features a llama.cpp build was compiled with: ``AVX2 = 1 | AMX_INT8 = 1 | ...``."""
    return frozenset(m.group(1) for m in re.finditer(r"(\w+) = 1\b", system_info))


# Weight types that ggml-cpu's extra buffers move into their own layout (repack.cpp's
# choice of interleaved kernels, by instruction set; the AMX buffer's qtype_has_amx_kernels).
_REPACKED_AVX2 = frozenset({"q4_0", "q4_k", "iq4_nl", "mxfp4"})
_REPACKED_AVX512 = frozenset({"q2_k"})
_REPACKED_NEON = frozenset({"q4_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "mxfp4", "q8_0"})
_REPACKED_AMX = frozenset({"q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs"})


# Weight types whose several-row products were checked to give each row the bits of its
# one-row product (tools/llamacpp_rows.py --rows, tests/backend_llamacpp/test_exact_rows.py):
# Q8_0, whose tiles sum each block as vec_dot does, and Q4_1 in Laya's build
# (patches/q4_1-gemm.patch). Float weights' tiles sum in another order; Q6_K and Q5_K_S
# copies of the embedded model differed from the second and the sixth row of a batch on
# (AMD EPYC); the other types are not checked.
_EXACT_ROWS = frozenset({"q4_1", "q8_0"})
# The local version label of a llama-cpp-python built with patches/exact-attention-rows.patch.
ROW_EXACT_LABEL = "rowexact"


def batch_invariance(flash_attn: object, version: str, weight_types: frozenset[str],
                     cpu: CpuInfo, repacked: frozenset[str], gpu_layers: int) -> tuple[bool, str]:
    """Whether each sequence's logits are the same bits whatever runs beside it (one row
    or a draft's several, alone or in a batch, a prompt in any chunks), and why (/ready's
    ``batch_invariant`` and ``batch_invariant_reason``). ``repacked``: the weight types
    moved into an extra buffer (empty when repacking is off)."""
    if flash_attn is not False:
        return False, ("flash attention on: its CPU kernel is chosen by the batch's shape "
                       "(flash_attn = false makes rows exact)")
    if gpu_layers:
        return False, "layers on a GPU: not checked row for row"
    if "avx2" not in cpu.flags:
        return False, "checked on x86 CPUs with AVX2 only"
    if ROW_EXACT_LABEL not in version:
        return False, (f"llama-cpp-python {version} computes a several-row attention in "
                       "other kernels than a one-row decode (make install builds it with "
                       "Laya's patches)")
    if not weight_types:
        return False, "the weights' types are not known"
    if other := sorted(weight_types - _EXACT_ROWS):
        return False, (f"{', '.join(other)} weights: their products with several rows are "
                       "not known to give each row its one-row bits")
    if moved := sorted(weight_types & repacked):
        return False, f"{', '.join(moved)} weights repacked: not checked row for row"
    return True, (f"{', '.join(sorted(weight_types))} weights and flash attention off: "
                  "every row is computed as a one-row decode computes it")


def repacked_types(cpu: CpuInfo, features: frozenset[str]) -> frozenset[str]:
    """The weight types llama.cpp would copy into an extra buffer on this CPU and build."""
    types: set[str] = set()
    if "avx2" in cpu.flags:
        types |= _REPACKED_AVX2
    if "avx512f" in cpu.flags:
        types |= _REPACKED_AVX512
    if "asimd" in cpu.flags or "neon" in cpu.flags:
        types |= _REPACKED_NEON
    if "amx_int8" in cpu.flags and "AMX_INT8" in features:
        types |= _REPACKED_AMX
    return frozenset(types)


def choose_mmap(option: object, repack: bool, matrix_types: frozenset[str],
                repacked: frozenset[str]) -> bool:
    """Whether to map the model file rather than read it.

    Mapping shares the file's pages with the page cache and other processes. But a weight
    that llama.cpp repacks is copied out of the mapping, and the mapped pages it was read
    from stay resident too: a Q4_0 copy of SmolLM2-135M grew RSS by 161 MiB mapped against
    105 MiB read (AMD EPYC), 57 MiB of weights held twice. So "auto" reads the file when
    some of its weight types get repacked, and maps it otherwise.
    """
    if isinstance(option, bool):
        return option
    return not (repack and matrix_types & repacked)


@attrs.frozen
class RepackChoice:
    enabled: bool
    reason: str


def choose_repack(option: object, cpu: CpuInfo, features: frozenset[str]) -> RepackChoice:
    """Whether llama.cpp may move weights into its extra buffer types (``use_extra_bufts``).

    The extra buffer types repack weights at load for faster kernels: CPU_REPACK
    (Q4_0, Q8_0, IQ4_NL and K-quants, interleaved for AVX2/AVX-512/NEON) and, in a build
    compiled on a CPU with AMX, the AMX buffer (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K,
    IQ4_XS). The AMX buffer's matrix multiply segfaults in the first ``llama_decode``
    (seen with llama-cpp-python 0.3.36 on a Sapphire Rapids Xeon, in llama-server too;
    upstream's report was closed without a fix), and llama.cpp switches all extra buffer
    types together. So "auto" keeps them where the AMX buffer cannot be chosen and turns them
    off where it could.
    """
    if option is True or option is False:
        return RepackChoice(option, f"repack = {str(option).lower()} in [models.options]")
    amx_cpu = "amx_int8" in cpu.flags
    amx_build = "AMX_INT8" in features
    if amx_cpu and amx_build:
        return RepackChoice(False, "auto: this CPU has AMX and llama.cpp was built with it; "
                                   "its AMX weight buffer crashes, so weights stay unpacked")
    return RepackChoice(True, "auto: no AMX weight buffer in this build or CPU; "
                              "llama.cpp repacks the types its CPU kernels interleave")
