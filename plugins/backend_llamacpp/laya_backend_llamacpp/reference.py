"""llama-cpp-python's own high-level ``Llama``, with its weights placed as this backend places
them by default: the reference tests compare with, and what tools/llamacpp_rows.py times.

On a CPU with AMX, in a llama.cpp built there, the extra buffer types take the AMX weight
buffer, whose matrix multiply segfaults in the first decode (``cpu.choose_repack``): an
unguarded reference took the whole pytest process down on such a machine (and so did
tools/llamacpp_rows.py's, in tests/backend_llamacpp/test_exact_rows.py). ``Llama`` has no
argument for it, so the model parameters' defaults are set while it loads.
"""

from __future__ import annotations

from typing import Any


def reference_llama(path: str, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(path, **kwargs)`` with ``use_extra_bufts`` as "auto" repack picks."""
    import llama_cpp

    from laya_backend_llamacpp import cpu

    ll = llama_cpp.llama_cpp
    ll.llama_backend_init()
    features = cpu.build_features(ll.llama_print_system_info().decode("utf-8", "replace"))
    repack = cpu.choose_repack("auto", cpu.read_cpuinfo(), features).enabled
    defaults = ll.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = repack
        return p

    ll.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=path, **kwargs)
    finally:
        ll.llama_model_default_params = defaults
