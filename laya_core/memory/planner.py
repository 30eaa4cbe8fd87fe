"""Makes the memory plan of a manifest, and says what would fit when it does not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from laya_core.backend import Backend, MemoryProfile, ModelConfig, Overhead
from laya_core.config.manifest import Manifest
from laya_core.config.table import Problems
from laya_core.engine.speculative import drafter_bytes_per_token
from laya_core.kv.dtypes import bytes_per_element
from laya_core.memory import budget as budget_mod
from laya_core.memory.ledger import (
    FRONT_TOKENIZER_BYTES_PER_TOKEN,
    GRAMMAR_CHILD_BYTES,
    GRAMMAR_VOCAB_BYTES_PER_TOKEN,
    RUNTIME_OVERHEAD_BYTES,
    WORKER_PROCESS_BYTES,
    Plan,
    ReplicaLedger,
    decide_sizes,
    sizes_for,
)
from laya_core.models.files import ModelFileError, ModelShape
from laya_core.plugins import Registry
from laya_core.structured.compiler import CACHE_BYTES as GRAMMAR_CACHE_BYTES
from laya_core.structured.sandbox import CompileLimits
from laya_core.units import fmt_bytes

_SEQ_LEN_STEP = 256  # suggested context lengths are multiples of this


def _backend_cls(registry: Registry, config: ModelConfig) -> type[Backend]:
    entry = registry.backends.get(config.backend)
    return entry.obj if entry else Backend  # not installed here: the generic profile


def _in_worker(profile: MemoryProfile, shape: ModelShape) -> MemoryProfile:
    """A replica's profile when it runs in a worker process of its own: that process's
    interpreter and libraries, the vocabulary the front end keeps to tokenize, and no line
    shared with other replicas (each worker loads its own copy). Weights mapped from the
    file are the worker's alone: the front end reads only the vocabulary."""
    own = tuple(attrs.evolve(o, shared=None) for o in profile.overheads)
    return attrs.evolve(profile, overheads=(
        *own,
        Overhead("worker process", WORKER_PROCESS_BYTES,
                 "Python, Laya and the backend's library in the replica's own process "
                 "(measured: 54 MiB with llama.cpp's after imports), with stacks and slack"),
        Overhead("front-end tokenizer", shape.vocab_size * FRONT_TOKENIZER_BYTES_PER_TOKEN,
                 f"the vocabulary the HTTP side tokenizes with, {FRONT_TOKENIZER_BYTES_PER_TOKEN}"
                 " B per token (measured: 17 MiB for llama.cpp's of 49,152 tokens)")))


def _with_constraints(profile: MemoryProfile, shape: ModelShape) -> MemoryProfile:
    """Structured output's share, built on first use (laya_core/structured/): the matcher's
    view of the vocabulary, the cache of compiled grammars (bounded in bytes), one compile
    at a time, and the child process that tries each grammar first (its interpreter, its
    own view of the vocabulary, and the memory one compile may add to it)."""
    vocab = shape.vocab_size * GRAMMAR_VOCAB_BYTES_PER_TOKEN
    compile_bytes = CompileLimits().memory_bytes
    child = GRAMMAR_CHILD_BYTES + vocab + compile_bytes
    return attrs.evolve(profile, overheads=(*profile.overheads, Overhead(
        "grammars", vocab + GRAMMAR_CACHE_BYTES + compile_bytes + child,
        f"structured output: the vocabulary's index ({GRAMMAR_VOCAB_BYTES_PER_TOKEN} B per "
        f"token, measured 25 MiB for 49,152) + the grammar cache ({fmt_bytes(GRAMMAR_CACHE_BYTES)}"
        f") + one compile ({fmt_bytes(compile_bytes)}) + the compile child "
        f"({fmt_bytes(child)}: interpreter, index, one compile)")))


def _with_drafts(profile: MemoryProfile, config: ModelConfig, shape: ModelShape,
                 cls: type[Backend]) -> MemoryProfile:
    """Speculative decoding's share: each running sequence's drafter indexes its tokens, and
    the running sequences hold at most the KV pool's tokens; or the draft model, with a
    pool like the model's (laya_core/engine/draft_model.py)."""
    assert config.speculative is not None
    if config.speculative.method == "draft":
        return _with_draft_model(profile, config, shape, cls)
    per_token = drafter_bytes_per_token(config.speculative)
    tokens = config.kv_cache_tokens or 0
    return attrs.evolve(profile, overheads=(*profile.overheads, Overhead(
        "speculative drafts", tokens * per_token,
        f"prompt lookup's n-gram index: {tokens} pool tokens x {per_token} B (measured "
        "391 B a token for n-grams of 2 to 4 tokens)")))


def _with_draft_model(profile: MemoryProfile, config: ModelConfig, shape: ModelShape,
                      cls: type[Backend]) -> MemoryProfile:
    """The draft model's weights, its KV pool (as many tokens as the model's, in its own
    layout) and its backend's overheads, each as a line of the model's replica."""
    from laya_core.engine.draft_model import draft_config

    sized = sizes_for(config, shape.n_ctx_train)
    draft = draft_config(sized)
    draft_shape = cls.model_shape(draft.path)
    p = cls.memory_profile(draft, draft_shape)
    tokens = draft.kv_cache_tokens or 0
    lines = [Overhead("draft model weights", p.weights_bytes,
                      f"{Path(draft.path).name}: {p.weights_source}"),
             Overhead("draft model KV", tokens * p.kv_bytes_per_token,
                      f"{tokens} tokens x {p.kv_bytes_per_token} B ({p.kv_dtype}), a pool "
                      "like the model's")]
    lines += [attrs.evolve(o, name=f"draft model {o.name}") for o in p.overheads]
    return attrs.evolve(profile, overheads=(*profile.overheads, *lines))


def _ledgers(configs: list[tuple[ModelConfig, ModelShape, type[Backend]]],
             processes: bool = False) -> list[ReplicaLedger]:
    ledgers, replica = [], 0
    for config, shape, cls in configs:
        profile = cls.memory_profile(config, shape)
        if cls.supports_constraints:
            profile = _with_constraints(profile, shape)
        if config.speculative is not None and cls.supports_speculative:
            profile = _with_drafts(profile, config, shape, cls)
        if processes and cls.load_tokenizer is not Backend.load_tokenizer:  # as Deployment
            profile = _in_worker(profile, shape)
        for _ in range(config.replicas):
            ledgers.append(ReplicaLedger(config.name, replica, config, profile,
                                         cls.cpu_threads(config)))
            replica += 1
    return ledgers


def _plan_for(configs: list[tuple[ModelConfig, ModelShape, type[Backend]]],
              budget: budget_mod.Budget, processes: bool = False) -> Plan:
    return Plan(tuple(_ledgers(configs, processes)), RUNTIME_OVERHEAD_BYTES, budget,
                processes=processes)


def uses_processes(manifest: Manifest, serving: bool) -> bool:
    """Whether the manifest's replicas run in processes of their own (worker processes or
    Ray actors): ``[cluster] engine``, and for "auto" whether ``laya serve`` runs it
    (``serving``) or code embeds it."""
    engine = manifest.cluster.engine
    return engine in ("process", "ray") or (engine == "auto" and serving)


def make_plan(manifest: Manifest, registry: Registry, serving: bool = False) -> Plan:
    """The plan of a resolved manifest (model paths are files or folders). ``serving``:
    planned as ``laya serve`` runs it (worker processes under ``[cluster] engine = "auto"``),
    rather than as a :class:`~laya_core.serving.deployment.Deployment` built in code."""
    processes = uses_processes(manifest, serving)
    configs, problems = [], Problems()
    for i, m in enumerate(manifest.models):
        key = f"models[{manifest.model_index.get(m.name, i)}]"
        cls = _backend_cls(registry, m)
        try:
            shape = cls.model_shape(m.path)
        except ModelFileError as e:
            problems.add(f"{key}.path", str(e))
            continue
        try:
            decided = decide_sizes(m, shape)
        except ValueError as e:
            problems.add(f"{key}.kv_cache_tokens", str(e))
            continue
        if m.kv_cache_dtype not in cls.kv_cache_dtypes:  # a backend not installed here
            problems.add(f"{key}.kv_cache_dtype", f"cannot price a {m.kv_cache_dtype!r} KV "
                         f"cache: the {m.backend} backend, which declares its KV types, is "
                         f"not installed here; plan where it is, or use "
                         f"{', '.join(cls.kv_cache_dtypes)}")
            continue
        configs.append((decided, shape, cls))
    problems.raise_if_any()
    budget = budget_mod.detect(manifest.memory.budget_bytes)
    # (Every model made it into configs: a problem raised above.)
    roomy = _plan_for([(decide_sizes(m, shape, cls), shape, cls) for m, (_, shape, cls)
                       in zip(manifest.models, configs, strict=True)], budget, processes)
    # Sized as a loaded engine sizes them: the default's 8 sequences where their KV is small
    # (ledger.default_num_seqs); where that plan does not fit, the fixed default's 4.
    if roomy.fits:
        return roomy
    plan = _plan_for(configs, budget, processes)
    if plan.fits:
        return plan
    return attrs.evolve(plan, suggestions=tuple(_suggestions(configs, plan.budget,
                                                             processes)))


def plan_added(plan: Plan, config: ModelConfig, registry: Registry) -> Plan:
    """``plan`` with one more model (resolved; a model found while serving): its replicas
    numbered after the plan's, its sizes decided as make_plan decides them. Raises
    :class:`ValueError` naming what is wrong (a file that is not a model)."""
    cls = _backend_cls(registry, config)
    try:
        shape = cls.model_shape(config.path)
    except ModelFileError as e:
        raise ValueError(str(e)) from None
    first = len(plan.replicas)

    def with_it(sized: ModelConfig) -> Plan:
        ledgers = _ledgers([(sized, shape, cls)], plan.processes)
        added = tuple(attrs.evolve(r, replica=first + i) for i, r in enumerate(ledgers))
        return attrs.evolve(plan, replicas=(*plan.replicas, *added), suggestions=())

    roomy = with_it(decide_sizes(config, shape, cls))  # as make_plan: the roomy default first
    return roomy if roomy.fits else with_it(decide_sizes(config, shape))


def decided_manifest(manifest: Manifest, plan: Plan) -> Manifest:
    """The manifest with every model's sizes as the plan decided them."""
    by_name = {r.model: r.config for r in plan.replicas}
    return attrs.evolve(manifest, models=tuple(by_name[m.name] for m in manifest.models))


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n), for fits monotone (true, then false)."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _suggestions(configs: list[tuple[ModelConfig, ModelShape, type[Backend]]],
                 budget: budget_mod.Budget, processes: bool = False) -> list[str]:
    if not any(c[0].on_demand for c in configs):
        out = [line for i in range(len(configs))
               for line in _suggest_for(i, configs, budget, processes)]
    else:  # the pinned models must fit together, and each on-demand one beside them
        pinned_at = [i for i, c in enumerate(configs) if not c[0].on_demand]
        pinned = [configs[i] for i in pinned_at]
        out = []
        if not _plan_for(pinned, budget, processes).fits:
            for j, i in enumerate(pinned_at):
                out += _suggest_for(j, pinned, budget, processes, f"models[{i}]")
        else:
            for i, entry in enumerate(configs):
                alone = [*pinned, entry]
                if entry[0].on_demand and not _plan_for(alone, budget, processes).fits:
                    out += _suggest_for(len(alone) - 1, alone, budget, processes,
                                        f"models[{i}]")
    if not out:
        out.append(f"nothing within these models fits {fmt_bytes(budget.bytes)}: the weights "
                   "and fixed overheads alone are too large; use a smaller or more quantized "
                   "model, or raise [memory] budget")
    return out


def _suggest_for(i: int, configs: list[tuple[ModelConfig, ModelShape, type[Backend]]],
                 budget: budget_mod.Budget, processes: bool = False,
                 key: str | None = None) -> list[str]:
    """Settings of model i that make the plan fit, the others unchanged; ``key``: how the
    lines name the model (``models[i]``)."""
    config, shape, cls = configs[i]

    def fits_with(**changes: Any) -> bool:
        trial = list(configs)
        trial[i] = (attrs.evolve(config, **changes), shape, cls)
        return _plan_for(trial, budget, processes).fits

    def fits_len(n: int, step_tokens: int = config.max_step_tokens) -> bool:
        length = n * _SEQ_LEN_STEP
        return fits_with(max_seq_len=length, kv_cache_tokens=length * seqs,
                         max_step_tokens=step_tokens)

    out, key = [], key or f"models[{i}]"
    seqs, seq_len = config.max_num_seqs or 1, config.max_seq_len or _SEQ_LEN_STEP
    steps = _largest(fits_len, 1, (seq_len - 1) // _SEQ_LEN_STEP)
    if steps:
        out.append(f"{key}.max_seq_len = {steps * _SEQ_LEN_STEP} (keeping max_num_seqs = {seqs})")
    n = _largest(lambda n: fits_with(max_num_seqs=n, kv_cache_tokens=n * seq_len), 1, seqs - 1)
    if n:
        out.append(f"{key}.max_num_seqs = {n} (keeping max_seq_len = {seq_len})")
    # The backend's KV types that cost less, the least cut first (llama.cpp's f16: q8_0, q4_0).
    price = cls.kv_cache_dtypes
    cheaper = sorted((d for d in price if bytes_per_element(d, price)
                      < bytes_per_element(config.kv_cache_dtype, price)),
                     key=lambda d: -bytes_per_element(d, price))
    for dtype in cheaper:
        if fits_with(kv_cache_dtype=dtype):
            out.append(f'{key}.kv_cache_dtype = "{dtype}" (a smaller KV element type)')
            break
    step = _largest(lambda n: fits_with(max_step_tokens=n * 64), max(1, -(-seqs // 64)),
                    (config.max_step_tokens - 1) // 64)
    if step:
        out.append(f"{key}.max_step_tokens = {step * 64} (a smaller compute buffer; long "
                   "prompts prefill in more steps)")
    if config.replicas > 1:
        r = _largest(lambda n: fits_with(replicas=n), 1, config.replicas - 1)
        if r:
            out.append(f"{key}.replicas = {r}")
    if not out:  # no single setting is enough: the smallest compute buffer, then context
        low_step = max(64, seqs)
        steps = _largest(lambda n: fits_len(n, low_step), 1, (seq_len - 1) // _SEQ_LEN_STEP)
        if steps:
            out.append(f"{key}.max_step_tokens = {low_step} together with "
                       f"{key}.max_seq_len = {steps * _SEQ_LEN_STEP}")
    return out


def format_plan(plan: Plan) -> str:
    """The ledger as a person reads it."""
    lines = []
    for r in plan.replicas:
        p = r.profile
        lines += [
            f"{r.model} (replica {r.replica}, backend {r.config.backend}): "
            f"max_seq_len {r.max_seq_len}, max_num_seqs {r.config.max_num_seqs}, "
            f"KV {p.kv_dtype}",
            f"  weights            {fmt_bytes(p.weights_bytes):>12}   {p.weights_source}",
            f"  KV per token       {fmt_bytes(p.kv_bytes_per_token):>12}",
            f"  KV per sequence    {fmt_bytes(r.kv_bytes_per_seq):>12}   at max_seq_len "
            f"{r.max_seq_len}",
            f"  KV pool            {fmt_bytes(r.kv_pool_bytes):>12}   {r.pool_tokens} tokens: "
            f"{r.max_concurrent_seqs} full-length sequence(s) at once",
        ]
        lines += [f"  {o.name:<18} {fmt_bytes(o.bytes):>12}   {o.how}"
                  + (f" (shared by this process's replicas: {o.shared})" if o.shared else "")
                  for o in p.overheads]
        lines.append(f"  replica total      {fmt_bytes(r.total_bytes):>12}")
    lines += [
        f"runtime              {fmt_bytes(plan.runtime_bytes):>12}   Python, HTTP server, "
        "libraries (once per process); the chat-template sandbox (64 MiB cap); the "
        "Responses API's stored responses (16.25 MiB cap)"
        + ("; each replica in a worker process of its own" if plan.processes else ""),
    ]
    if plan.shared_bytes_counted_once:
        lines.append(f"shared, once         {fmt_bytes(-plan.shared_bytes_counted_once):>12}   "
                     "the replicas' shared lines, each counted once in the total")
    if (largest := plan.largest_on_demand) is not None:
        pinned = sorted({r.model for r in plan.pinned})
        on_demand = sorted({r.model for r in plan.replicas if r.config.on_demand})
        lines += [
            f"pinned               {fmt_bytes(sum(r.total_bytes for r in plan.pinned)):>12}"
            f"   load = always: {', '.join(pinned) or 'none'}",
            f"largest on demand    {fmt_bytes(plan.model_bytes(largest)):>12}   {largest}, "
            f"of {len(on_demand)} loaded on demand ({', '.join(on_demand)}): each must fit "
            "beside the pinned ones; the total counts the largest",
        ]
    lines += [
        f"total                {fmt_bytes(plan.total_bytes):>12}",
        f"budget               {fmt_bytes(plan.budget.bytes):>12}   {plan.budget.source}",
    ]
    if plan.fits:
        lines.append(f"fits: {fmt_bytes(plan.budget.bytes - plan.total_bytes)} to spare")
    else:
        lines.append(f"DOES NOT FIT: {fmt_bytes(plan.total_bytes - plan.budget.bytes)} over "
                     "budget. " + ("Any one of these would fit:" if plan.largest_on_demand is None
                                   else "Each model named needs one of its lines (the pinned "
                                   "models must fit together, each on-demand one beside them):"))
        lines += [f"  {s}" for s in plan.suggestions]
    return "\n".join(lines)
