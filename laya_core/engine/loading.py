"""What an engine builds over its backend once the weights are loaded: the cache policy's
pool over the backend's KV cache, and the scheduler that plans steps over that pool.

The sizes come decided (``laya_core/memory/ledger.py``'s ``sizes_for``, the same computation
as ``laya plan``'s); nothing here chooses one.
"""

from __future__ import annotations

from laya_core.backend import Backend, ModelConfig
from laya_core.engine.scheduler import Scheduler, SchedulerConfig
from laya_core.kv.policies import KVCache
from laya_core.memory.ledger import scored_tokens_per_step


def build_scheduler(config: ModelConfig, sizes: ModelConfig, backend: Backend,
                    scheduler_cls: type[Scheduler], cache_cls: type[KVCache]) -> Scheduler:
    """The scheduler of ``config``'s replica over ``backend``, whose KV cache the cache
    policy allocates now; raises ``ValueError`` when the policy serves another KV layout."""
    assert sizes.max_num_seqs and sizes.kv_cache_tokens
    num_seqs, pool_tokens = sizes.max_num_seqs, sizes.kv_cache_tokens
    if cache_cls.layout != backend.kv_layout:
        raise ValueError(
            f"the cache policy {cache_cls.__name__} serves the "
            f"{cache_cls.layout} KV layout; the {backend.name} backend's is "
            f"{backend.kv_layout}: choose a cache_policy for it, or leave it auto")
    kv = cache_cls(pool_tokens, num_seqs, prefix_caching=config.prefix_caching,
                   block_size=backend.block_size)
    kv.allocate(backend)
    step_tokens = sizes.max_step_tokens
    sched_config = SchedulerConfig(
        num_seqs, step_tokens, max_scored_tokens=scored_tokens_per_step(step_tokens))
    return scheduler_cls(sched_config, kv)
