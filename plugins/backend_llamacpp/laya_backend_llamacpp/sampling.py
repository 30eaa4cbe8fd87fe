"""Builds a llama.cpp sampler chain for one sequence from its :class:`SamplingParams`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from laya_core.engine.allowed_tokens import AllowedTokens
from laya_core.types import Sample, SamplingParams

from laya_backend_llamacpp.memory import SCORE_BLOCK_ROWS

_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a random seed


def build_chain(ll: Any, params: SamplingParams, n_vocab: int) -> Any:
    """penalties -> top-k -> top-p -> min-p -> temperature -> draw, or greedy at temperature 0.

    The chain is per sequence, so a seeded request draws the same tokens whatever runs beside it.
    Penalties look at the tokens this sequence generated (the window is max_tokens long), as
    OpenAI's presence and frequency penalties do. Returns None for plain greedy decoding (no
    penalties): the caller takes the arg-max of the logits itself, which is the same token
    (the first of equal maxima, as llama.cpp's greedy sampler picks) without the chain's copy
    of the whole vocabulary (measured: about 0.17 ms a token for 49,152 tokens).
    """
    penalties = (params.presence_penalty, params.frequency_penalty,
                 params.repetition_penalty) != (0.0, 0.0, 1.0)
    if params.greedy and not penalties:
        return None
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    if penalties:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
            n_vocab, params.max_tokens, params.repetition_penalty, params.frequency_penalty,
            params.presence_penalty))
    if params.greedy:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
    seed = _RANDOM_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
    return chain


def sample_row(ll: Any, ctx: Any, chain: Any, row: int, logits: np.ndarray,
               allowed: AllowedTokens | None, top: int | None) -> Sample:
    """The next token from batch row ``row``, and its log-probabilities when ``top`` is set.

    ``logits`` is llama.cpp's own output row (a view, [vocab] float32), which ``chain``
    (None: plain greedy) reads from the context. The mask is written into it first, so the
    whole chain (penalties, top-k, top-p, min-p, temperature, the draw) sees the allowed
    tokens only: a masked token has probability 0 and is never drawn, and the truncations
    count the allowed tokens alone. Log-probabilities come from the row as the model gave it.
    ``allowed`` must allow some token (``AllowedTokens.is_empty`` is checked before).
    """
    raw = logits
    if allowed is not None:
        if top is not None:
            raw = logits.astype(np.float64)  # the unmasked distribution, for logprobs
        allowed.mask_logits(logits)
    if chain is None:
        token = int(logits.argmax())
    else:
        token = int(ll.llama_sampler_sample(chain, ctx, row))
        if allowed is not None and not allowed.allows(token):
            # llama.cpp's draw takes the first candidate whose running sum of probabilities
            # reaches u x total; at u = 0 exactly (a 2^-53 chance) that can be a candidate
            # of probability 0. The allowed arg-max stands in.
            token = int(logits.argmax())
    if top is None:
        return Sample(token)
    return logprobs_of(raw, token, top)


def logprobs_of(logits: Any, token: int, top: int) -> Sample:
    """The chosen token's log-probability and the ``top`` likeliest, from raw logits.

    Computed on the model's own distribution, before penalties and truncation, as vLLM does.
    """
    x = np.asarray(logits, dtype=np.float64)
    peak = x.max()
    log_total = peak + np.log(np.exp(x - peak).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(x, -top)[-top:]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i] - log_total)) for i in ids)
    return Sample(token, float(x[token] - log_total), best)


def score_rows(logits: Any, targets: Any, top: int) -> tuple[Sample, ...]:
    """Each row's target token with its log-probability, rank and the ``top`` likeliest.

    ``logits``: [rows, vocab] raw logits, one row per target. The work is numpy's over the
    whole block, so a prompt position costs a few vector passes, not a Python loop over the
    vocabulary; the caller keeps blocks small (the float64 copies are rows x vocab x 8 B).
    """
    x = np.asarray(logits, dtype=np.float64)  # [rows, vocab]
    rows = np.arange(len(x))
    peak = x.max(axis=1)
    shifted = x - peak[:, None]  # the one other block-sized array
    log_total = peak + np.log(np.exp(shifted, out=shifted).sum(axis=1))
    del shifted
    chosen = x[rows, np.asarray(targets)]
    ranks = (x > chosen[:, None]).sum(axis=1) + 1
    best: list[tuple[tuple[int, float], ...]] = [()] * len(x)
    if top:
        ids = np.argpartition(x, -top, axis=1)[:, -top:]
        ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(x, ids, axis=1), axis=1,
                                                 kind="stable"), axis=1)
        values = np.take_along_axis(x, ids, axis=1) - log_total[:, None]
        best = [tuple(zip(r_ids.tolist(), r_vals.tolist(), strict=True))
                for r_ids, r_vals in zip(ids, values, strict=True)]
    logprobs = (chosen - log_total).tolist()
    return tuple(Sample(int(t), lp, b, rank=int(r)) for t, lp, b, r
                 in zip(targets, logprobs, best, ranks.tolist(), strict=True))


def score_targets(row_logits: Callable[[int], Any], n_vocab: int, first_row: int,
                  targets: Sequence[int], top: int) -> tuple[Sample, ...]:
    """The scores of ``targets`` (a prompt's tokens), from batch rows ``first_row ..``:
    ``row_logits(row)`` is that row's float32 pointer (llama_get_logits_ith). Blocks of
    ``SCORE_BLOCK_ROWS`` rows bound the float64 copies (rows x vocab x 8 B)."""
    block = np.empty((min(SCORE_BLOCK_ROWS, len(targets)), n_vocab), np.float64)
    out: list[Sample] = []
    for start in range(0, len(targets), SCORE_BLOCK_ROWS):
        part = targets[start:start + SCORE_BLOCK_ROWS]
        for k in range(len(part)):
            block[k] = np.ctypeslib.as_array(row_logits(first_row + start + k),
                                             shape=(n_vocab,))
        out += score_rows(block[:len(part)], part, top)
    return tuple(out)
