"""The llama.cpp backend's embedding context (``LlamaCppBackend.allocate_embedder``).

A llama.cpp context of its own, beside the slots' (memory.py,
``embeddings``). A context of its own rather than a slot of the main one: a slot
is the cache policy's, and the main context computes no hidden states.
Pooling is ``none`` here and done in ``Embedder.step``, so an input is fed in chunks
over several decodes whatever the model's pooling.

Its KV is one buffer of ``max_seq_len`` cells (``kv_unified``) that up to one batch
of inputs share, each its own llama.cpp sequence (``n_seq_max``), so short inputs
go through one decode together; llama.cpp masks each sequence's attention to its
own cells, and places a batch's tokens in any free cells. ``n_seq_max`` is at most
the batch's size because llama.cpp keeps output rows for that many sequences,
which the plan counts (the batch's rows).

With flash attention off (the default) an input alone in the buffer gets the same
bits in any chunks. Beside other inputs it can differ in its last digits (72 inputs
of 2 to 120 tokens in 128-token passes: cosine 0.99938 at the least against alone;
a one-token input always the same bits): its attention then sums over cells at
other offsets, which llama.cpp's vectorized sums group otherwise. With flash
attention on, a decode of 64 tokens or more also takes another kernel (tiled) than a
smaller one (0.9984). Batching is kept because it is what makes many short inputs
cheap (2,048 one-token inputs in 16 decodes: 13.8 s of CPU against 37 s in 2,048);
    the slots' context, and so a generation's determinism, is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from laya_backend_llamacpp.memory import (
    GGML_TYPE,
    LLAMA_FLASH_ATTN,
    embed_batch_tokens,
    embed_cells,
    flash_attention,
)
from laya_core.backend import ModelConfig
from laya_core.engine.embed_jobs import EmbedChunk, EmbedPlan, pooled_rows


class Embedder:
    """One llama.cpp context with embeddings on, and the sums of the inputs under way."""

    def __init__(self, ll: Any, model: Any, config: ModelConfig, threads: int,
                 pooling: str) -> None:
        self._ll, self.pooling = ll, pooling
        self._batch_tokens = embed_batch_tokens(config)
        params = ll.llama_context_default_params()
        params.n_ctx = embed_cells(config)
        params.n_batch = params.n_ubatch = self._batch_tokens
        params.n_seq_max = self.max_inputs = self._batch_tokens
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPE[config.kv_cache_dtype]
        params.flash_attn_type = LLAMA_FLASH_ATTN[flash_attention(config)]
        params.embeddings = True
        params.pooling_type = 0  # LLAMA_POOLING_TYPE_NONE: each row's hidden state
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the embedding context")
        self.batch = ll.llama_batch_init(params.n_batch, 0, 1)
        self._n_embd = ll.llama_model_n_embd(model)
        # Per embedding sequence: the sum of its pooled rows so far (float64).
        self._sums: dict[int, np.ndarray] = {}

    def step(self, plan: EmbedPlan, threads: int | None) -> list[np.ndarray | None]:
        """Feed ``plan``'s chunks in decodes of the batch's size (``threads``: the count to
        use now, None to keep it); each input's pooled rows are summed as they come, and a
        finished input's vector is returned in its chunk's place (None for the others)."""
        if threads is not None:
            self._ll.llama_set_n_threads(self.ctx, threads, threads)
        for seq in plan.dropped:
            self.drop(seq)
        # One row per token: (chunk index, position, token, whether pooling reads it).
        rows = [(i, c.start + j, token, j in wanted)
                for i, c in enumerate(plan.chunks)
                for wanted in [pooled_rows(self.pooling, c.start, len(c.tokens), c.last)]
                for j, token in enumerate(c.tokens)]
        size = self._batch_tokens
        try:
            for begin in range(0, len(rows), size):
                self._decode(plan.chunks, rows[begin:begin + size])
        except BaseException:
            for c in plan.chunks:
                self.drop(c.seq)
            raise
        out: list[np.ndarray | None] = []
        for c in plan.chunks:
            if not c.last:
                out.append(None)
                continue
            pooled = self._sums.pop(c.seq, np.zeros(self._n_embd, np.float64))
            self.drop(c.seq)
            out.append(pooled / (c.start + len(c.tokens)) if self.pooling == "mean" else pooled)
        return out

    def _decode(self, chunks: Sequence[EmbedChunk],
                rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of ``rows`` (at most a batch); adds the pooled rows' hidden
        states to their sequences' sums."""
        ll, ctx, batch = self._ll, self.ctx, self.batch
        for j, (i, pos, token, wanted) in enumerate(rows):
            batch.token[j] = token
            batch.pos[j] = pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = chunks[i].seq
            batch.logits[j] = wanted
        batch.n_tokens = len(rows)
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} embedding {len(rows)} tokens")
        for j, (i, _, _, wanted) in enumerate(rows):
            if wanted:
                seq = chunks[i].seq
                row = np.ctypeslib.as_array(ll.llama_get_embeddings_ith(ctx, j),
                                            shape=(self._n_embd,))
                if seq in self._sums:
                    self._sums[seq] += row
                else:
                    self._sums[seq] = row.astype(np.float64)

    def drop(self, seq: int) -> None:
        """Forget embedding sequence ``seq``: its KV cells and its sum (either may be gone)."""
        self._sums.pop(seq, None)
        self._ll.llama_memory_seq_rm(self._ll.llama_get_memory(self.ctx), seq, -1, -1)

    def close(self) -> None:
        if self.batch is not None:
            self._ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self._ll.llama_free(self.ctx)
            self.ctx = None
