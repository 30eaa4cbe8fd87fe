"""Loading a GGUF file into llama.cpp and making the slots' context
(``LlamaCppBackend.load_weights`` and ``allocate_cache``).

The parameters llama.cpp gets, chosen from the CPU, the build and the ``[models.options]``
(``cpu.py``, ``memory.py``), and what the backend reads back from the loaded model: the
runtime report of ``describe`` and the :class:`ModelInfo`. ``llama_cpp`` is imported by
:func:`llama`, never at import time.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from typing import Any

from laya_backend_llamacpp import cpu, memory
from laya_backend_llamacpp.llama_log import LLAMA_LOG, weight_buffers
from laya_backend_llamacpp.memory import GGML_TYPE, LLAMA_FLASH_ATTN, flash_attention
from laya_backend_llamacpp.metadata import metadata_problem
from laya_backend_llamacpp.tokenizer import LlamaTokenizer, special_texts, token_text
from laya_core.backend import ModelConfig, ModelInfo
from laya_core.models.files import read_shape
from laya_core.models.pooling import DEFAULT_POOLING

_LOAD_MODE = {True: 1, False: 0}  # use_mmap -> llama_load_mode: MMAP, NONE


def llama() -> Any:
    import llama_cpp

    return llama_cpp


def load_model(ll: Any, config: ModelConfig) -> tuple[Any, dict[str, Any], str]:
    """The model of ``config.path``, the runtime report of its load and its embedding pooling.

    Repacking and mmap follow the options ``repack`` and ``use_mmap`` (``cpu.choose_repack``,
    ``cpu.choose_mmap``); the report names the CPU, the build's features and where the
    weights went (llama.cpp's log of its buffers)."""
    LLAMA_LOG.install(ll)
    ll.llama_backend_init()
    host = cpu.read_cpuinfo()
    features = cpu.build_features(ll.llama_print_system_info().decode("utf-8", "replace"))
    repack = cpu.choose_repack(config.options.get("repack", "auto"), host, features)
    shape = read_shape(config.path, metadata_problem)  # refuses what llama.cpp aborts on
    pooling = shape.pooling or DEFAULT_POOLING
    use_mmap = cpu.choose_mmap(
        config.options.get("use_mmap", "auto"), repack.enabled,
        shape.matrix_types, cpu.repacked_types(host, features))
    params = ll.llama_model_default_params()
    params.load_mode = _LOAD_MODE[use_mmap]
    params.use_extra_bufts = repack.enabled
    offload = _gpu_params(ll, config, params)
    with LLAMA_LOG.capture() as lines:
        model = ll.llama_model_load_from_file(config.path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {config.path}")
    version = _installed_version()
    invariant, why = cpu.batch_invariance(
        flash_attention(config), version,
        shape.matrix_types | ({shape.head_type} if shape.head_type else set()), host,
        cpu.repacked_types(host, features) if repack.enabled else frozenset(),
        offload["n_gpu_layers"])
    runtime: dict[str, Any] = {
        "cpu": host.model, "cpu_flags": host.notable_flags,
        "llama_cpp_version": version,
        "batch_invariant": invariant, "batch_invariant_reason": why,
        "llama_cpp_features": sorted(features),
        "repack": repack.enabled, "repack_reason": repack.reason,
        "use_mmap": use_mmap,
        "weight_buffer_bytes": weight_buffers(lines),
        "embedding_pooling": pooling,
        **offload,
    }
    return model, runtime, pooling


def _installed_version() -> str:
    """llama-cpp-python's version: "0.3.36+laya.q41gemm.rowexact" for the build `make install` makes
    (plugins/backend_llamacpp/build_llama_cpp.py), "0.3.36" for PyPI's, slower on Q4_1."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_SPLIT_MODE = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode


def _gpu_params(ll: Any, config: ModelConfig, params: Any) -> dict[str, Any]:
    """Set the model's GPU offload from ``n_gpu_layers`` and its split options (as the
    memory plan decided them: "auto" left undecided offloads nothing); what was set, for
    the runtime report. A build without GPU support cannot offload: said, not ignored."""
    layers = memory.gpu_layers(config)
    params.n_gpu_layers = layers
    if not layers:
        return {"n_gpu_layers": 0}
    if not ll.llama_supports_gpu_offload():
        raise RuntimeError(f"n_gpu_layers = {layers}, but this llama-cpp-python was built "
                           "without GPU support; rebuild it with CUDA (make install GPU=cuda)")
    mode = config.options.get("split_mode", "layer")
    params.split_mode = _SPLIT_MODE[mode]
    params.main_gpu = int(config.options.get("main_gpu", 0))
    split = config.options.get("tensor_split")
    if split:
        # Kept on the params object: llama.cpp reads the array during the load.
        params._laya_tensor_split = (ctypes.c_float * memory.MAX_GPUS)(*map(float, split))
        params.tensor_split = ctypes.cast(params._laya_tensor_split,
                                          ctypes.POINTER(ctypes.c_float))
    return {"n_gpu_layers": layers, "split_mode": mode, "main_gpu": params.main_gpu,
            "tensor_split": split}


def model_info(ll: Any, model: Any) -> tuple[ModelInfo, Any, int, LlamaTokenizer]:
    """What the loaded ``model`` tells of itself, its vocabulary, the vocabulary's size and
    the tokenizer over it."""
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    template = ll.llama_model_chat_template(model, None)
    desc = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, desc, len(desc))
    specials = special_texts(ll, vocab, n_vocab)
    tokenizer = LlamaTokenizer(ll, vocab, n_vocab, specials)
    info = ModelInfo(
        n_ctx_train=ll.llama_model_n_ctx_train(model),
        vocab_size=n_vocab,
        eog_token_ids=frozenset(t for t in range(n_vocab) if ll.llama_vocab_is_eog(vocab, t)),
        chat_template=template.decode("utf-8") if template else None,
        bos_token=token_text(ll, vocab, ll.llama_vocab_bos(vocab)),
        eos_token=token_text(ll, vocab, ll.llama_vocab_eos(vocab)),
        add_bos=bool(ll.llama_vocab_get_add_bos(vocab)),
        description=desc.value.decode("utf-8", "replace"),
        special_tokens=specials,
    )
    return info, vocab, n_vocab, tokenizer


def context_params(ll: Any, config: ModelConfig, *, n_ctx: int, max_num_seqs: int,
                   threads: int, unified: bool) -> Any:
    """The slots' context's parameters: ``n_ctx`` cells for ``max_num_seqs`` sequences, one
    KV buffer (``unified``) or a stream per slot, ``threads`` compute threads."""
    params = ll.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_seq_max = max_num_seqs
    # One step feeds at most max_step_tokens tokens; a larger batch would only waste the
    # compute buffer, whose size grows with n_ubatch.
    params.n_batch = params.n_ubatch = config.max_step_tokens
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = unified
    params.type_k = params.type_v = GGML_TYPE[config.kv_cache_dtype]
    params.no_perf = True
    params.flash_attn_type = LLAMA_FLASH_ATTN[flash_attention(config)]
    params.offload_kqv = bool(config.options.get("offload_kqv", True))
    return params
