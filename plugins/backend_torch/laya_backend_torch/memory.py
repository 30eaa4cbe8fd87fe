"""What one torch replica costs, from the checkpoint's metadata (nothing is loaded).

The weights are priced as they sit in memory after load, not as stored: a Q4_1 GGUF is
dequantized, so its matrices cost the compute dtype's bytes, or one byte plus a scale per
row with ``quantize = "int8"``. The KV pool is priced by the KV dtype; one step's
activations, logits and the torch library itself are the overheads.
"""

from __future__ import annotations

from laya_core.backend import ModelConfig
from laya_core.memory_plan import MemoryProfile, Overhead, kv_bytes_per_token
from laya_core.model_files import ModelShape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# libtorch's resident size once imported and warmed up (kernels, allocator, thread pools):
# measured 245-280 MiB with torch 2.13.0 (CPU build) on an AMD EPYC.
TORCH_RUNTIME_BYTES = 270 * 2**20
# The tokenizer's vocabulary, merges and caches, per token of the vocabulary (measured:
# about 12 MiB for 49,152 tokens with tokenizers 0.23).
_TOKENIZER_BYTES_PER_TOKEN = 256


def planned_dtype(config: ModelConfig) -> str:
    """The compute dtype ``options.choose`` will pick, without importing torch."""
    from laya_backend_torch.options import native_bf16

    dtype = config.options.get("dtype", "auto")
    if dtype != "auto":
        return str(dtype)
    if str(config.options.get("device", "cpu")).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if native_bf16() else "float32"


def weight_bytes(config: ModelConfig) -> tuple[int, str]:
    """The loaded weights' bytes, and how they were counted."""
    from laya_backend_torch.checkpoint import read_config

    c = read_config(config.path)
    dtype = planned_dtype(config)
    size = _DTYPE_BYTES[dtype]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = (q + 2 * kv) + c.hidden_size + 2 * c.intermediate_size + c.hidden_size
    matrices = c.num_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size
                               + 3 * c.hidden_size * c.intermediate_size)
    vectors = c.num_layers * 2 * c.hidden_size + c.hidden_size
    if c.attention_bias:
        vectors += c.num_layers * (q + 2 * kv)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    if config.options.get("quantize", "none") == "int8":
        scales = c.num_layers * rows + c.vocab_size * (1 if c.tie_word_embeddings else 2)
        total = matrices + embeddings + (vectors + scales) * size
        return total, f"{dtype} with int8 matrices (one {dtype} scale per row)"
    return (matrices + embeddings + vectors) * size, f"{dtype}, every tensor"


def memory_profile(config: ModelConfig, shape: ModelShape) -> MemoryProfile:
    weights, how = weight_bytes(config)
    dtype = planned_dtype(config)
    size = _DTYPE_BYTES[dtype]
    step, seqs = config.max_step_tokens, config.max_num_seqs or 1
    ctx = config.max_seq_len or 4096
    kv_width = shape.n_kv_heads * (shape.head_dim_k + shape.head_dim_v)
    # One step: the residual stream and its normed copy, q/k/v, the attention output and
    # the MLP's gate/up/product (about 3 x intermediate, taken as 8 x hidden) per token,
    # plus the widest attention read (a chunk's or the decode batch's whole history,
    # gathered K and V) and one chunk's attention scores, in float32.
    per_token = (4 * shape.hidden_size + 3 * shape.n_heads * shape.head_dim_k
                 + 8 * shape.hidden_size) * size
    history = max(ctx, seqs * ctx) * kv_width * size
    scores = shape.n_heads * step * ctx * 4
    activations = step * per_token + history + scores
    from laya_core.memory_plan import scored_tokens_per_step

    rows = seqs + scored_tokens_per_step(step)
    return MemoryProfile(
        weights_bytes=weights, weights_source=f"{shape.weights_source}; loaded as {how}",
        kv_bytes_per_token=kv_bytes_per_token(shape, config.kv_cache_dtype),
        kv_dtype=config.kv_cache_dtype,
        overheads=(
            Overhead("step activations", activations,
                     f"{step} step tokens x activations per token, + the longest history "
                     f"read ({seqs} x {ctx} tokens of K and V), + one chunk's attention "
                     "scores"),
            Overhead("logits", rows * shape.vocab_size * (4 + 8),
                     f"{rows} rows (sequences + scored prompt rows) x vocab x (4 B, + 8 B "
                     "to score them)"),
            Overhead("torch runtime", TORCH_RUNTIME_BYTES,
                     "libtorch resident once loaded (measured, torch 2.13 CPU)"),
            Overhead("vocabulary", shape.vocab_size * _TOKENIZER_BYTES_PER_TOKEN,
                     f"{_TOKENIZER_BYTES_PER_TOKEN} B per token (the tokenizer's tables)"),
        ))
