"""What one replica of an ExLlama model holds, and where (``Backend.memory_profile``).

On the GPUs (laya_backend_exl2/placement.py decides which): the weights but the token
embedding, each layer's KV cache with its layer, the generator's scratch, a quantized
cache's dequantization buffer, and a CUDA context per GPU. In host RAM: the token embedding
(both libraries keep it there), CUDA torch with the library, the tokenizers and the logits
the generator copies back to sample.
"""

from __future__ import annotations

from laya_backend_exl2 import options
from laya_backend_exl2.folder import Folder
from laya_backend_exl2.placement import Placement
from laya_core.backend import MemoryProfile, ModelConfig, Overhead
from laya_core.kv.dtypes import KVDtypes, kv_bytes_per_token
from laya_core.memory.devices import CUDA_CONTEXT_BYTES
from laya_core.models.files import ModelShape

MIB = 2**20
# The cache's element types, priced per 32 elements of a token's K or V row as both
# libraries store them: f16 in 2 B an element; q8, q6 and q4 quantized in groups of 32 with
# one fp16 scale each (32 B + 2, 24 B + 2, 16 B + 2). exllamav2's "q6" keeps K in 8 bits and
# V in 4 (26 B a group on average); exllamav3's in 6 and 6. A head_dim that is no multiple of
# 32 is rounded up to whole groups here, as the libraries' kernels require it anyway.
KV_DTYPES: KVDtypes = {"f16": (1, 2), "q8": (32, 34), "q6": (32, 26), "q4": (32, 18)}
# CUDA torch, its libraries' host side (cuBLAS, the driver's) and the library's compiled
# extension in host RAM: an estimate (CUDA torch is commonly 1-2 GiB of RSS once its context
# exists), not yet measured on a GPU of this project's; tools/gpu_check.sh measures it.
RUNTIME_HOST_BYTES = 1536 * MIB
# Two tokenizers hold the vocabulary, Laya's (tokenizers, from tokenizer.json) and the
# library's own with its lists of token texts: each priced as the torch backend measured its
# HF tokenizer (16 MiB + 820 B a token), not measured for these libraries.
TOKENIZER_BYTES = 2 * 16 * MIB
TOKENIZER_BYTES_PER_TOKEN = 2 * 820


def _kv_per_layer(shape: ModelShape, dtype: str) -> int:
    return kv_bytes_per_token(shape, dtype, KV_DTYPES) // max(1, shape.n_layers)


def _gpu_lines(config: ModelConfig, shape: ModelShape, folder: Folder,
               place: Placement) -> list[Overhead]:
    dtype, pool = config.kv_cache_dtype, options.pool_tokens(config)
    planned = config.kv_cache_tokens or pool
    per_layer = _kv_per_layer(shape, dtype)
    lines = []
    for device, layers, s in zip(place.devices, place.layers, place.scratch, strict=True):
        lines.append(Overhead(f"CUDA context {device}", CUDA_CONTEXT_BYTES,
                              "estimate: the driver's state and the kernels loaded (torch's, "
                              "the library's, flash-attn's); tools/gpu_check.sh measures it",
                              shared="cuda context", device=device))
        lines.append(Overhead(f"generator scratch {device}", s.bytes, s.how, device=device))
        if pool > planned and layers:
            lines.append(Overhead(
                f"KV pages {device}", (pool - planned) * per_layer * layers,
                f"the pool rounded up to whole pages of {options.PAGE_TOKENS} tokens: "
                f"{pool - planned} tokens more", device=device))
        if dtype != "f16" and layers:
            # exllamav2 keeps an fp16 K and V of one layer's whole cache per GPU to attend
            # from (ExLlamaV2Cache_Q.temp_tensors); exllamav3 allocates it per call.
            row = shape.n_kv_heads * (shape.head_dim_k + shape.head_dim_v)
            lines.append(Overhead(f"KV dequantization {device}", pool * row * 2,
                                  f"one layer's {pool}-token cache in fp16, to attend from",
                                  device=device))
    if not folder.has_head:  # tied: the libraries make the head from the embedding, in fp16
        lines.append(Overhead(f"output head {place.head_device}",
                              shape.vocab_size * shape.hidden_size * 2,
                              "the tied embedding copied to the GPU as the head, fp16",
                              device=place.head_device))
    return lines


def memory_profile(config: ModelConfig, shape: ModelShape, folder: Folder, place: Placement,
                   library: str) -> MemoryProfile:
    per_layer = _kv_per_layer(shape, config.kv_cache_dtype)
    rows = options.max_num_seqs(config)
    vocab = -(-shape.vocab_size // 32) * 32  # the generator pads its logits to 32
    host = [
        Overhead(f"{library} runtime", RUNTIME_HOST_BYTES,
                 f"estimate: CUDA torch and {library}'s extension in host RAM; "
                 "tools/gpu_check.sh measures it", shared=library),
        Overhead("vocabulary", TOKENIZER_BYTES + shape.vocab_size * TOKENIZER_BYTES_PER_TOKEN,
                 f"Laya's tokenizer and {library}'s: 2 x (16 MiB + 820 B a token), as the "
                 "torch backend measured its own"),
        Overhead("sampled logits", rows * vocab * 4,
                 f"{rows} rows of float32 logits copied back to sample"),
    ]
    return MemoryProfile(
        weights_bytes=shape.weights_bytes, weights_source=shape.weights_source,
        kv_bytes_per_token=kv_bytes_per_token(shape, config.kv_cache_dtype, KV_DTYPES),
        kv_dtype=config.kv_cache_dtype,
        overheads=(*_gpu_lines(config, shape, folder, place), *host),
        weights_on=dict(zip(place.devices, place.weights, strict=True)),
        kv_bytes_per_token_on={d: n * per_layer for d, n in
                               zip(place.devices, place.layers, strict=True)})
