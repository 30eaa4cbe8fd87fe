"""llama-cpp-python's own high-level ``Llama``, the reference some tests compare with, with
its weights placed as Laya's llama.cpp backend places them by default.

On a CPU with AMX, in a llama.cpp built there, the extra buffer types take the AMX weight
buffer, whose matrix multiply segfaults in the first decode (``cpu.choose_repack``): an
unguarded reference took the whole pytest process down on such a machine. ``Llama`` has no
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
