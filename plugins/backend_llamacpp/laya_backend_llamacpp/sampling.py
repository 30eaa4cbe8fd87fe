"""Builds a llama.cpp sampler chain for one sequence from its :class:`SamplingParams`."""

from __future__ import annotations

from typing import Any

from laya_core.types import SamplingParams

_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a random seed


def build_chain(ll: Any, params: SamplingParams) -> Any:
    """top-k -> top-p -> min-p -> temperature -> draw, or greedy at temperature 0.

    The chain is per sequence, so a seeded request draws the same tokens whatever runs beside it.
    """
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
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
