"""What a llama.cpp replica costs, as llama.cpp's allocator sizes its buffers on the CPU, and
how its KV pool is laid out (streams or one shared buffer); nothing here loads llama.cpp."""

from __future__ import annotations

import math

from laya_core.backend import MemoryProfile, ModelConfig, Overhead
from laya_core.kv.dtypes import FLOAT_KV_DTYPES, kv_bytes_per_token
from laya_core.memory.ledger import sampled_rows_per_step, scored_tokens_per_step
from laya_core.models.files import ModelShape

_KV_CELL_ALIGN = 256  # llama.cpp pads each KV stream to this many cells
_VOCAB_BYTES_PER_TOKEN = 512
# llama_state_seq_get_data writes each cell's position and sequence ids besides its K and V.
SAVED_CELL_BYTES = 16
# Tokens of one llama_decode of the embedding context (and its batch size): its compute and
# output buffers grow with it, and 128-token passes embed 1,024 tokens in 0.52 s against
# 0.55 s at 256 (2 threads, AMD EPYC), so more would only cost memory.
EMBED_BATCH_TOKENS = 128
# Measured beyond the embedding context's KV, compute and output buffers: its RSS grew by
# 75.0 MiB at n_ctx 1,024 and 98.7 at 2,048 (batch 128) where those add up to 71.3 and 93.8.
EMBED_SLACK_BYTES = 4 * 2**20
# Prompt rows scored per numpy pass: the pass holds two float64 copies of the block
# (2 x 8 x vocab x 8 B, 6 MiB for 49,152 tokens), counted in the memory profile.
SCORE_BLOCK_ROWS = 8


def _prompt_logits(vocab_size: int, num_rows: int) -> Overhead:
    """llama.cpp's output buffer grows to hold every row asked for logits (it never shrinks),
    so the prompt rows one step may score are planned, with the scratch that scores them."""
    scratch = 2 * SCORE_BLOCK_ROWS * vocab_size * 8
    return Overhead("prompt logits", vocab_size * num_rows * 4 + scratch,
                    f"vocab x {num_rows} scored prompt rows per step x 4 B, + 2 x "
                    f"{SCORE_BLOCK_ROWS} rows x vocab x 8 B to score them")


# What llama.cpp's context parameters take for the KV element type and flash_attn.
GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}  # enum ggml_type
# The KV element types ggml stores, priced (LlamaCppBackend.kv_cache_dtypes): name ->
# (elements per block, bytes per block); q8_0 and q4_0 pack 32 values with an f16 scale.
GGML_KV_DTYPES = {**FLOAT_KV_DTYPES, "q8_0": (32, 34), "q4_0": (32, 18)}
LLAMA_FLASH_ATTN = {"auto": -1, False: 0, True: 1}  # enum llama_flash_attn_type


def flash_attention(config: ModelConfig) -> bool | str:
    """The ``flash_attn`` option in force: false unless the manifest says otherwise.

    Off, a greedy request's tokens and log-probabilities are the same alone, beside any
    neighbours, from the prefix cache or cold, at any thread count. On ("auto" or true),
    llama.cpp's CPU flash attention picks its kernel by the batch's shape (a tiled one for 64
    or more query rows of a sequence, a KV split across threads for one lone query over 512
    or more cells), so the same prompt answered differently cold and from the cache (20 of 20
    cached repeats of one chat differed from its first answer, Intel Xeon). The cost of off
    is in docs/benchmarks.md."""
    value: bool | str = config.options.get("flash_attn", False)
    return value


def saved_kv_tokens(config: ModelConfig, n_ctx: int) -> int:
    """Tokens of evicted streams' KV kept in host memory for later prompts: the option, or a
    quarter of the pool. A stream holds one sequence, so without these only as many
    conversations as slots stay cached; with them, 12 conversations of 330 tokens revisited
    on 4 slots all reuse their KV (tools/measure_prefix_reuse.py)."""
    value = config.options.get("saved_kv_tokens")
    return n_ctx // 4 if value is None else int(value)


def kv_layout(config: ModelConfig, n_ctx: int, num_seqs: int) -> tuple[bool, int]:
    """Whether the slots share one KV buffer, and the cells llama.cpp will allocate.

    Each slot gets a KV stream of its own whenever the pool holds max_seq_len for every slot
    (the default): attention then runs over that sequence's cells alone, so a sequence's
    output does not depend on what shares its batch (measured: 16 staggered greedy requests,
    3 diverged from their solo runs within 24 tokens with one shared buffer, none with
    streams). A pool smaller than that (kv_cache_tokens) must be shared. llama.cpp rounds
    each stream up to a multiple of 256 cells.
    """
    unified = config.options.get("kv_unified")
    if unified is None:
        unified = config.max_seq_len is not None and n_ctx < config.max_seq_len * num_seqs
    streams = 1 if unified else num_seqs
    per_stream = math.ceil(math.ceil(n_ctx / streams) / _KV_CELL_ALIGN) * _KV_CELL_ALIGN
    return bool(unified), per_stream * streams



def embed_cells(config: ModelConfig) -> int:
    """The embedding context's KV cells: one input of max_seq_len, rounded as llama.cpp does."""
    return math.ceil((config.max_seq_len or 1) / _KV_CELL_ALIGN) * _KV_CELL_ALIGN


def embed_batch_tokens(config: ModelConfig) -> int:
    return min(EMBED_BATCH_TOKENS, config.max_step_tokens)


def _embeddings(config: ModelConfig, shape: ModelShape, per_token: int) -> Overhead:
    """The embedding context (``backend.py``, ``embed``): a llama.cpp context of its own, so
    an embedding never touches a slot's KV. Its KV holds one input of max_seq_len; its
    compute buffer is sized like the main one for its batch; with embeddings on, llama.cpp
    keeps every batch row's logits and hidden state in its output buffer."""
    cells, batch = embed_cells(config), embed_batch_tokens(config)
    compute = batch * (shape.vocab_size + 2 * shape.hidden_size) * 4
    if not flash_attention(config):
        compute += batch * cells * shape.n_heads * 4
    outputs = batch * (shape.vocab_size + shape.hidden_size) * 4
    return Overhead("embeddings", cells * per_token + compute + outputs + EMBED_SLACK_BYTES,
                    f"a context of its own: KV of {cells} cells + {batch}-token compute "
                    f"buffer + {batch} output rows x (vocab + hidden) x 4 B + "
                    f"{EMBED_SLACK_BYTES // 2**20} MiB (measured)")


def memory_profile(config: ModelConfig, shape: ModelShape) -> MemoryProfile:
    """llama.cpp's buffers, as its allocator sizes them on the CPU.

    Checked against llama.cpp's own report for SmolLM2-135M: with flash attention the
    compute buffer is n_ubatch x (vocab + 2 x hidden) x 4 B and a little more, 98.25 MiB at
    n_ubatch 512 with 4 streams of 4,096 cells, 102.51 MiB with 4 of 2,048.
    Without it (the default), a step's attention scores and their float32 mask, n_ubatch x
    the cells one sequence's attention spans x (heads + 1) x 4 B, live before the logits do,
    so the buffer holds the larger of the two, plus a little: 99.38 MiB with 4 streams of
    4,096 cells (scores 80 MiB), 326.38 MiB with one buffer of 16,384 cells (320 MiB);
    counted as the larger + n_ubatch x hidden x 32 B (9 MiB at 512).
    """
    step, seqs = config.max_step_tokens, config.max_num_seqs or 1
    sampled = sampled_rows_per_step(config)
    pool = config.kv_cache_tokens or 0
    per_token = kv_bytes_per_token(shape, config.kv_cache_dtype, GGML_KV_DTYPES)
    unified, cells = kv_layout(config, pool, seqs)
    saved = saved_kv_tokens(config, pool)
    compute = step * (shape.vocab_size + 2 * shape.hidden_size) * 4
    how = f"{step} step tokens x (vocab {shape.vocab_size} + 2 x hidden) x 4 B"
    if not flash_attention(config):
        view = cells if unified else cells // seqs  # the cells one attention spans
        scores = step * view * (shape.n_heads + 1) * 4
        compute = max(compute, scores)
        how = (f"the larger of {how} and attention scores with their mask (flash attention "
               f"off: {step} x {view} cells x (heads {shape.n_heads} + 1) x 4 B)")
    compute += step * shape.hidden_size * 32  # the rest: masks, norms (measured, below)
    how += f", + {step} x hidden x 32 B"
    weights_on, kv_on, gpus = gpu_placement(config, shape, per_token)
    weights, source = shape.weights_bytes, shape.weights_source
    if gpus:
        n = min(gpu_layers(config), shape.n_layers + 1)
        source += (f"; n_gpu_layers {n}: the last {min(n, shape.n_layers)} of "
                   f"{shape.n_layers} layers" + (" and the output head" if n > shape.n_layers
                                                 else "") + " on the GPU")
    if shape.output_tied and shape.n_layers in layer_devices(config, shape.n_layers):
        weights += shape.output_bytes
        source += "; the tied output head copied to the GPU"
    return MemoryProfile(
        weights_bytes=weights, weights_source=source,
        kv_bytes_per_token=per_token, kv_dtype=config.kv_cache_dtype,
        weights_on=weights_on, kv_bytes_per_token_on=kv_on,
        overheads=(
            *_gpu_overheads(gpus, compute, how),
            Overhead("compute buffer", compute, how),
            Overhead("KV padding", (cells - pool) * per_token,
                     f"{cells} cells in {'one buffer' if unified else f'{seqs} streams'}: "
                     f"llama.cpp rounds each to {_KV_CELL_ALIGN}"),
            Overhead("logits buffer", shape.vocab_size * sampled * 4,
                     f"vocab x {seqs} sequences x 4 B" if sampled == seqs else
                     f"vocab x {sampled} sampled rows ({seqs} sequences and their draft "
                     "tokens) x 4 B"),
            _prompt_logits(shape.vocab_size, scored_tokens_per_step(step)),
            Overhead("saved KV", saved * (per_token + SAVED_CELL_BYTES),
                     f"{saved} tokens of evicted streams' KV kept "
                     f"in host memory (saved_kv_tokens) x (KV per token + "
                     f"{SAVED_CELL_BYTES} B)"),
            *([_embeddings(config, shape, per_token)] if config.embeddings else []),
            Overhead("vocabulary", shape.vocab_size * _VOCAB_BYTES_PER_TOKEN,
                     f"{_VOCAB_BYTES_PER_TOKEN} B per token (measured: about 20 MiB for "
                     "49,152 tokens)"),
            *([lora_overhead(config, shape)] if config.lora_slots else []),
        ))


def lora_overhead(config: ModelConfig, shape: ModelShape) -> Overhead:
    """The LoRA adapters: llama.cpp holds each GGUF adapter's matrices as stored, in a
    buffer of their own. Room for adapters loaded while serving is priced at the rank limit
    on every module, in float32 (the largest type an adapter file may use)."""
    from laya_core.models.lora import rank_limit, read_gguf_adapter

    adapters = [read_gguf_adapter(path) for path in config.lora.values()]
    rank = rank_limit(config.max_lora_rank, [a.rank for a in adapters])
    extra = config.lora_slots - len(adapters)
    how = [f"{len(adapters)} of the lora table (rank "
           f"{'/'.join(map(str, sorted({a.rank for a in adapters})))}), as stored"] \
        if adapters else []
    room = 0
    if extra:
        h, ffn = shape.hidden_size, _feed_forward_length(config.path)
        q, kv = shape.n_heads * shape.head_dim_k, shape.n_kv_heads * shape.head_dim_k
        v, o = shape.n_kv_heads * shape.head_dim_v, shape.n_heads * shape.head_dim_v
        features = (h + q) + (h + kv) + (h + v) + (o + h) + 2 * (h + ffn) + (ffn + h)
        room = extra * shape.n_layers * features * rank * 4
        how.append(f"room for {extra} loaded while serving, each of rank up to {rank} on "
                   "every module, float32")
    return Overhead("LoRA adapters", sum(a.nbytes for a in adapters) + room, "; ".join(how))


def _feed_forward_length(path: str) -> int:
    """The MLP's intermediate size, from the GGUF file's ``{arch}.feed_forward_length`` (the
    largest, where it is given per layer)."""
    from pathlib import Path

    from laya_core.models.gguf_header import read_gguf_header

    meta = read_gguf_header(Path(path), keep_items=4096).metadata
    value = meta.get(f"{meta.get('general.architecture')}.feed_forward_length")
    values = value if isinstance(value, list) else [value]
    return max((int(v) for v in values if isinstance(v, int)), default=0)


# GPU offload (``n_gpu_layers``): llama.cpp puts the last n repeating layers on the GPUs,
# and with n above the layer count the output head too; the token embedding stays in host
# memory. Each offloaded layer's KV goes with it (``offload_kqv``, on by default).
SPLIT_MODES = ("layer", "row", "none")
MAX_GPUS = 16  # llama.cpp's LLAMA_MAX_DEVICES in CUDA builds


def gpu_layers(config: ModelConfig) -> int:
    """The layers ``n_gpu_layers`` offloads; "auto" not yet decided by a plan: none."""
    value = config.options.get("n_gpu_layers", "auto")
    return value if type(value) is int and value > 0 else 0


def split_shares(config: ModelConfig) -> list[float]:
    """Each GPU's share of the offloaded layers: ``tensor_split`` normalized ([1.0]: one)."""
    split = [float(x) for x in config.options.get("tensor_split") or [1.0]]
    total = sum(split)
    return [x / total for x in split]


def layer_devices(config: ModelConfig, n_layers: int) -> dict[int, int]:
    """Which GPU each offloaded layer goes to (index n_layers: the output head), as
    llama.cpp assigns them: layer mode cuts the offloaded span by the cumulative shares;
    row and none keep each layer's KV and compute on ``main_gpu``."""
    n = gpu_layers(config)
    first = max(0, n_layers - n)
    layers = list(range(first, n_layers)) + ([n_layers] if n > n_layers else [])
    mode = config.options.get("split_mode", "layer")
    main = int(config.options.get("main_gpu", 0))
    if mode != "layer":
        return {il: main for il in layers}
    shares = split_shares(config)
    bounds = [sum(shares[:i + 1]) for i in range(len(shares))]
    span = max(1, n_layers - first)
    out = {}
    for il in layers:
        at = min(il, n_layers) - first
        gpu = next((i for i, b in enumerate(bounds) if at / span < b), len(bounds) - 1)
        out[il] = gpu
    return out


def gpu_placement(config: ModelConfig, shape: ModelShape,
                  per_token: int) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(weights by GPU, KV bytes per token by GPU, the GPUs used) for ``n_gpu_layers``."""
    from laya_core.memory.devices import gpu_name

    where = layer_devices(config, shape.n_layers)
    if not where:
        return {}, {}, []
    weights: dict[str, int] = {}
    kv: dict[str, int] = {}
    per_layer_kv = per_token // max(1, shape.n_layers)
    row = config.options.get("split_mode", "layer") == "row"
    for il, gpu in where.items():
        size = shape.output_bytes if il == shape.n_layers else shape.layer_weights(il)
        if row:  # each layer's matrices cut across the GPUs by the shares
            for i, share in enumerate(split_shares(config)):
                if share:
                    weights[gpu_name(i)] = weights.get(gpu_name(i), 0) + int(size * share)
        else:
            weights[gpu_name(gpu)] = weights.get(gpu_name(gpu), 0) + size
        if il < shape.n_layers and config.options.get("offload_kqv", True):
            kv[gpu_name(gpu)] = kv.get(gpu_name(gpu), 0) + per_layer_kv
    used = sorted({*weights, *kv}, key=lambda d: int(d.split(":")[1]))
    return weights, kv, used


def _gpu_overheads(gpus: list[str], compute: int, how: str) -> list[Overhead]:
    """Each GPU's own lines: the process's CUDA context there, and a compute buffer sized
    as the host's (llama.cpp allocates one per device for the graph's part it runs)."""
    from laya_core.memory.devices import CUDA_CONTEXT_BYTES

    out = []
    for d in gpus:
        out += [Overhead("CUDA context", CUDA_CONTEXT_BYTES, "the driver's and libraries' "
                         "state (an estimate; tools/gpu_check.sh measures it)", device=d),
                Overhead("GPU compute buffer", compute, f"as the host's: {how}", device=d)]
    return out
