"""What one torch replica costs, from the checkpoint's metadata (nothing is loaded), and the
load's part in keeping that true.

The weights are priced as they sit in memory after load, not as stored: a Q4_1 GGUF is
dequantized, so its matrices cost the compute dtype's bytes, or one byte plus a scale per
row with ``quantize = "int8"``, or half a byte plus a scale and a zero per 32 with
``quantize = "int4"`` (whose output head is int8). The KV pool is priced by the KV dtype.
The overheads are one step's activations and its logits (each the peak of the largest step
the scheduler may make; glibc keeps a step's freed memory for the next, so it stays
resident), libtorch, the tokenizer, and what the load needs for a moment beyond all of
them.

Every constant below was measured with tests/memory/torch_rss_stages.py (RSS and its peak,
VmHWM, at each stage; torch 2.13.0 CPU, tokenizers 0.23, an AMD EPYC with AVX512-BF16), and
tests/memory/test_torch_ledger.py checks the ledger against it in float32, bfloat16, int8 and int4.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from laya_backend_torch.options import INT4_GROUP
from laya_core.backend import MemoryProfile, ModelConfig, Overhead
from laya_core.kv.dtypes import kv_bytes_per_token
from laya_core.memory.devices import CUDA_CONTEXT_BYTES
from laya_core.memory.ledger import sampled_rows_per_step, scored_tokens_per_step
from laya_core.models.files import ModelShape

if TYPE_CHECKING:
    from laya_backend_torch.checkpoint import LlamaConfig

MIB = 2**20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# libtorch imported (218.5 MiB: its code, data and allocator) and its kernels run once, on a
# one-layer model of the replica's dtype (21-33 MiB more of its code touched): 240 MiB with
# int8, 242 in float32, 251 in bfloat16, whose dense 16-bit matrix kernels are more code;
# a thread adds its stack and its malloc arena (0.5-2 MiB measured). Most of it is libtorch's
# code mapped from its files, and how much of that is resident depends on the page cache
# (the kernel maps cached pages around each fault): the same float32 stage measured 209 to
# 283 MiB from run to run. The plan takes the most measured.
TORCH_RUNTIME_BYTES = 280 * MIB
TORCH_RUNTIME_16_BIT_KERNELS_BYTES = 10 * MIB
TORCH_RUNTIME_BYTES_PER_THREAD = 2 * MIB
# The tokenizer: two tokenizers.Tokenizer (with and without special-token parsing) and the
# token texts, 38 MiB for 49,152 tokens; the tokenizers library's code (6 MiB) and its word
# cache, full after a few thousand tokens of text (10 MiB).
TOKENIZER_BYTES = 16 * MIB
TOKENIZER_BYTES_PER_TOKEN = 820
# Reading a GGUF vocabulary (gguf_checkpoint.read_metadata: its strings as Python objects,
# 9.1 MiB for 49,152 tokens and as many merges, and the header's bytes, 4 MiB) holds for a
# moment what the tokenizer does not keep.
VOCAB_READ_BYTES_PER_TOKEN = 300
# Quantizing the output head (the tied embedding, or lm_head) to int8 at the end of the load
# holds it in float32 (4 B an element) with two float32 temporaries (w / scale, rounded)
# while its int8 copy (1 B) is made: 11 B an element above the loaded weights.
INT8_HEAD_TRANSIENT_BYTES = 11
# A step: its fixed part (positions, index tensors, rotary rows: 4.8 MiB measured in
# float32, and 3 MiB for the heap's fragmentation across steps of other sizes), and per
# token the residual stream, q/k/v, attention output and MLP (gate, up and their product,
# with the kernels' float32 scratch): 8 x (hidden + intermediate) x dtype bytes measured
# (7.3 in bfloat16, 8.0 in float32); int8's weight-only kernel adds 10 x (hidden +
# intermediate) B; attention runs in float32 (model.py): q and its output add 8 B an element.
STEP_FIXED_BYTES = 8 * MIB
# Attention gathers each sequence's history from the pool and converts it to float32: the
# pool's bytes + 4 + 4 of the kernel's own per element of K and V (8.3 to 9.6 B measured
# with an f16 pool).
HISTORY_EXTRA_BYTES = 8
# Logits, per element of a row: a scored row's float32 logits, their float64 copy and its
# log-softmax, 22 B (measured); a sampled row's logits, their copy and the sampler's work
# (penalties, the row ranked by int64 keys for top-k and top-p, min-p), 56 B (measured with
# all of them). Both count: the sampler's freed tensors stay in the heap while a later step
# scores.
SCORED_ROW_BYTES = 22
SAMPLED_ROW_BYTES = 56
# glibc's malloc raises its mmap threshold to the largest block freed after being mapped (at
# most 32 MiB on 64-bit), so a step's float32 logits come from the heap after the first, and
# its trim threshold to twice that: up to twice the block stays resident, free, at the heap's
# top between steps, and the next step's peak stands on it (measured: 10 to 56 MiB left by
# the steps before a scored chunk of 128 rows, whose float32 logits are 24 MiB).
MMAP_THRESHOLD_MAX = 32 * MIB
# A CUDA build of torch in host RAM once it has made its context: libtorch_cuda, cuBLAS,
# cuDNN and the driver's host side. An estimate (commonly 1-2 GiB of RSS), not measured on
# a GPU of this project's yet: tools/gpu_check.sh prints the measured one.
TORCH_CUDA_RUNTIME_BYTES = 1536 * MIB


def planned_device(config: ModelConfig) -> str:
    """The device the replica's tensors live on: "cpu" or a GPU's name ("cuda:0")."""
    device = str(config.options.get("device", "cpu"))
    return "cuda:0" if device == "cuda" else device


def planned_dtype(config: ModelConfig) -> str:
    """The compute dtype ``options.choose`` will pick, without importing torch."""
    from laya_backend_torch.options import native_bf16

    dtype = config.options.get("dtype", "auto")
    if dtype != "auto":
        return str(dtype)
    if str(config.options.get("device", "cpu")).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if native_bf16() else "float32"


def planned_threads(config: ModelConfig) -> int:
    """The torch threads ``options.choose`` will start with."""
    from laya_core.engine.threads import physical_cores

    threads = config.options.get("n_threads", "auto")
    return physical_cores() if threads == "auto" else int(threads)


def weight_bytes(config: ModelConfig, c: LlamaConfig, quantize: str,
                 group: int = INT4_GROUP) -> tuple[int, str]:
    """The loaded weights' bytes, and how they were counted. ``group``: the int4 layers'
    inputs per group (a GPTQ or AWQ folder's own; 32 for every other checkpoint)."""
    dtype = planned_dtype(config)
    size = _DTYPE_BYTES[dtype]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = (q + 2 * kv) + c.hidden_size + 2 * c.intermediate_size + c.hidden_size
    matrices = c.num_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size
                               + 3 * c.hidden_size * c.intermediate_size)
    vectors = c.num_layers * 2 * c.hidden_size + c.hidden_size
    if c.attention_bias:
        vectors += c.num_layers * (q + 2 * kv)
    embedding = c.vocab_size * c.hidden_size
    if quantize != "none":
        # The output head in int8 with a bfloat16 scale per row; an untied input embedding
        # stays dense. The layers' matrices in int8 too, or in int4: half a byte an element
        # and a 16-bit scale and zero per 32 (quant.Q4Linear's float16 scale and minimum, or
        # Int4Linear's bfloat16 pair; a matrix neither takes, quant.int4_fits, is int8: none
        # in the Llama shapes this is planned for).
        dense = 0 if c.tie_word_embeddings else embedding * size
        head = embedding + c.vocab_size * 2
        if quantize == "int8":
            layers = matrices + c.num_layers * rows * 2
            how = "int8 matrices (one bfloat16 scale per row)"
        else:
            layers = matrices // 2 + matrices // group * 4
            how = (f"int4 layer matrices (a 16-bit scale and zero per {group}) and an int8 "
                   "output head")
        return layers + head + dense + vectors * size, f"{dtype} with {how}"
    embeddings = embedding * (1 if c.tie_word_embeddings else 2)
    return (matrices + embeddings + vectors) * size, f"{dtype}, every tensor"


def packed_group_size(path: str) -> int:
    """The int4 group size a GPTQ or AWQ folder's layers keep (its quantization_config's
    group_size where the int4 kernel takes it), else the kernel's 32."""
    import json

    folder = Path(path)
    if not folder.is_dir():
        return INT4_GROUP
    try:
        qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return INT4_GROUP
    group = qc.get("group_size") if isinstance(qc, dict) else None
    return group if group in (32, 64, 128, 256) else INT4_GROUP


def activation_bytes(config: ModelConfig, c: LlamaConfig, shape: ModelShape,
                     quantize: str) -> int:
    """The largest step's activations: every step token through the layers, plus the
    widest attention read, at most the whole pool's history."""
    size = _DTYPE_BYTES[planned_dtype(config)]
    width = c.hidden_size + c.intermediate_size
    per_token = 8 * width * size + 8 * c.num_heads * c.head_dim
    if quantize != "none":
        per_token += 10 * width
    kv_width = shape.n_kv_heads * (shape.head_dim_k + shape.head_dim_v)
    pool_bytes = kv_bytes_per_token(shape, config.kv_cache_dtype) // (shape.n_layers
                                                                     * kv_width)
    return (STEP_FIXED_BYTES + config.max_step_tokens * per_token
            + history_tokens(config) * kv_width * (pool_bytes + HISTORY_EXTRA_BYTES))


def embed_cells(config: ModelConfig) -> int:
    """Slots of the embedding scratch (backend.py, ``embed``): one input of max_seq_len, in
    whole blocks of 16."""
    return -(-(config.max_seq_len or 4096) // 16) * 16


def pool_tokens(config: ModelConfig) -> int:
    return config.kv_cache_tokens or (config.max_seq_len or 4096) * (config.max_num_seqs or 1)


def history_tokens(config: ModelConfig) -> int:
    """The most history one step's attention reads: every sequence at full length, but no
    more than the pool holds."""
    return min((config.max_seq_len or 4096) * (config.max_num_seqs or 1), pool_tokens(config))


def logits_bytes(config: ModelConfig, vocab_size: int) -> tuple[int, int, int]:
    """A step's logits at their peak: (bytes, sampled rows, scored rows)."""
    sampled, scored = sampled_rows_per_step(config), scored_tokens_per_step(config.max_step_tokens)
    row_bytes = SCORED_ROW_BYTES * scored + SAMPLED_ROW_BYTES * sampled
    return row_bytes * vocab_size, sampled, scored


def heap_kept_bytes(config: ModelConfig, vocab_size: int) -> int:
    """What glibc may keep of the steps' freed memory, resident: twice the largest float32
    block of logits a step frees, as far as it raises the mmap threshold."""
    rows = max(sampled_rows_per_step(config), scored_tokens_per_step(config.max_step_tokens))
    return 2 * min(rows * vocab_size * 4, MMAP_THRESHOLD_MAX)


def load_transient_bytes(config: ModelConfig, c: LlamaConfig, weights: int,
                         vocabulary: int, quantize: str) -> int:
    """What the load holds for a moment above the loaded weights and tokenizer."""
    reading = 0
    if not Path(config.path).is_dir():  # a GGUF file's vocabulary
        reading = max(0, c.vocab_size * VOCAB_READ_BYTES_PER_TOKEN - weights - vocabulary)
    if quantize == "none":
        return reading
    return max(reading, c.vocab_size * c.hidden_size * INT8_HEAD_TRANSIENT_BYTES)


def memory_profile(config: ModelConfig, shape: ModelShape) -> MemoryProfile:
    from laya_backend_torch.checkpoint import read_header
    from laya_backend_torch.options import quantization

    c, stored = read_header(config.path)
    quantize, _ = quantization(config.options, stored)  # as options.choose will
    weights, how = weight_bytes(config, c, quantize, packed_group_size(config.path))
    kv_per_token = kv_bytes_per_token(shape, config.kv_cache_dtype)
    activations = activation_bytes(config, c, shape, quantize)
    logits, sampled, scored = logits_bytes(config, shape.vocab_size)
    vocabulary = TOKENIZER_BYTES + shape.vocab_size * TOKENIZER_BYTES_PER_TOKEN
    threads = planned_threads(config)
    runtime = TORCH_RUNTIME_BYTES
    if planned_dtype(config) != "float32" and quantize == "none":
        runtime += TORCH_RUNTIME_16_BIT_KERNELS_BYTES
    # The load's transient is over before the pool, activations and logits exist; only what
    # they do not cover is planned on top.
    later = kv_per_token * pool_tokens(config) + activations + logits
    load = max(0, load_transient_bytes(config, c, weights, vocabulary, quantize) - later)
    device = planned_device(config)
    gpu = device != "cpu"
    overheads = [
        Overhead("step activations", activations,
                 f"{config.max_step_tokens} step tokens x 8 x (hidden + intermediate) x dtype "
                 f"bytes, + the widest attention read ({history_tokens(config)} tokens of K "
                 "and V)", device=device),
        Overhead("logits", logits,
                 f"vocab x ({sampled} sampled rows x {SAMPLED_ROW_BYTES} B (logits, sampler) "
                 f"+ {scored} scored rows x {SCORED_ROW_BYTES} B (logits, log-softmax))",
                 device=device),
        # On a GPU the steps' memory is the CUDA caching allocator's, not the C library's.
        *([] if gpu else [Overhead(
            "heap kept", heap_kept_bytes(config, shape.vocab_size),
            "freed step memory the C library keeps resident below its trim threshold: "
            "twice a step's largest float32 logits (capped by the 32 MiB mmap threshold)")]),
        # Allocated (zeroed) with the pool; an embedding's passes are no larger than a
        # step's, and run between steps, so their activations are the step's line.
        *([Overhead("embeddings", embed_cells(config) * kv_per_token,
                    f"the embedding scratch: KV of one input of {embed_cells(config)} tokens "
                    "(max_seq_len), in the pool's dtype", device=device)]
          if config.embeddings else []),
        # One libtorch per process: replicas in one process share it, and the plan
        # counts it once; each replica's engine thread has its own OpenMP threads.
        Overhead("torch runtime", TORCH_CUDA_RUNTIME_BYTES if gpu else runtime,
                 "libtorch with CUDA's libraries, host side (an estimate; "
                 "tools/gpu_check.sh measures it)" if gpu else
                 "libtorch imported and its kernels run (measured, torch 2.13 CPU)",
                 shared="libtorch"),
        *([Overhead("CUDA context", CUDA_CONTEXT_BYTES, "the driver's and libraries' state "
                    "(an estimate; tools/gpu_check.sh measures it)", shared=f"cuda {device}",
                    device=device)] if gpu else []),
        Overhead("torch threads", threads * TORCH_RUNTIME_BYTES_PER_THREAD,
                 f"{threads} threads' stacks and heap arenas (measured)"),
        Overhead("vocabulary", vocabulary,
                 f"the tokenizer: {TOKENIZER_BYTES_PER_TOKEN} B per token + its library "
                 "(measured)"),
    ]
    if config.lora_slots:
        overheads.append(attrs.evolve(lora_overhead(config, c), device=device))
    if gpu:  # the load reads on the host; what it makes goes to the GPU
        load = load_transient_bytes(config, c, weights, vocabulary, quantize)
    if load:
        overheads.append(Overhead(
            "load peak", load, "what the load holds for a moment (reading the vocabulary, "
            "quantizing the output head) beyond the pool, activations and logits after it"))
    return MemoryProfile(
        weights_bytes=weights, weights_source=f"{shape.weights_source}; loaded as {how}",
        kv_bytes_per_token=kv_per_token, kv_dtype=config.kv_cache_dtype,
        overheads=tuple(overheads),
        weights_on={device: weights} if gpu else {},
        kv_bytes_per_token_on={device: kv_per_token} if gpu else {})


def lora_overhead(config: ModelConfig, c: Any) -> Overhead:
    """The LoRA adapters, every one loaded with the model (laya_backend_torch/lora.py)."""
    from laya_backend_torch.lora import dtype_for, fused_bytes, largest_bytes
    from laya_core.models.lora import rank_limit, read_adapter

    dtype = dtype_for(config.options.get("deterministic") is True)
    element = dtype.itemsize

    adapters = [read_adapter(folder) for folder in config.lora.values()]
    rank = rank_limit(config.max_lora_rank, [a.rank for a in adapters])
    extra = config.lora_slots - len(adapters)
    how = [f"{len(adapters)} of the lora table (rank "
           f"{'/'.join(map(str, sorted({a.rank for a in adapters})))})"] if adapters else []
    if extra:
        how.append(f"room for {extra} loaded while serving, each of rank up to {rank} on "
                   "every module")
    return Overhead("LoRA adapters",
                    sum(fused_bytes(a, c, element) for a in adapters)
                    + extra * largest_bytes(rank, c, element),
                    "; ".join(how) + ": A and B matrices fused as the layers are, "
                    + str(dtype).removeprefix("torch."))


def as_kept(tensors: Iterator[tuple[str, Any]], dtype: Any, quantized: bool,
            tied: bool) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, each in the dtype the model keeps it in as soon as it is
    read (with ``quantized``, the matrices it quantizes stay float32), with the heap's freed
    pages given back after each.

    The checkpoint dequantizes to float32 and the model holds a tensor until its layer is
    complete (the embedding until the end), so converting late holds float32 copies; and
    glibc keeps the pages the layers' temporaries freed, which added up to 330 MiB for
    SmolLM2-135M in int8 (128 MiB of weights)."""
    heads = ("lm_head.weight", "model.embed_tokens.weight") if tied else ("lm_head.weight",)
    for name, tensor in tensors:
        # A GroupQuant (a 4-bit matrix as stored) is kept as it is: each matrix kind takes it.
        if hasattr(tensor, "to") and not (
                quantized and (name.endswith("_proj.weight") or name in heads)):
            tensor = tensor.to(dtype)
        yield name, tensor
        release_freed_heap()


def release_freed_heap() -> None:
    """Give the pages of freed heap memory back to the kernel (glibc's ``malloc_trim``; a
    no-op where the C library has none). glibc keeps freed chunks resident for reuse, so
    without this the load's temporaries stay in RSS, where the plan does not count them."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
