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
from laya_core.memory import devices
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


def _ledgers(configs: list[Entry],
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


Entry = tuple[ModelConfig, ModelShape, type[Backend]]


@attrs.frozen
class Room:
    """What a plan is checked against: the host's budget and each GPU's."""

    host: budget_mod.Budget
    gpus: devices.Gpus = devices.NO_GPUS


@attrs.frozen
class Machine:
    """The machine a plan is for, where it is not this one (``laya plan --ram --gpus``):
    its RAM (None: this machine's budget) and its GPUs' sizes (None: this machine's)."""

    ram_bytes: int | None = None
    gpus: tuple[int, ...] | None = None


def _plan_for(configs: list[Entry], room: Room, processes: bool = False) -> Plan:
    return Plan(tuple(_ledgers(configs, processes)), RUNTIME_OVERHEAD_BYTES, room.host,
                processes=processes, gpus=room.gpus)


def _placed(configs: list[Entry], room: Room, processes: bool) -> list[Entry]:
    """``configs`` with their device options decided (``Backend.place``), and each "auto"
    of a backend's ``gpu_layers_option``, model by
    model in the manifest's order: the most layers whose GPU share fits every GPU's budget
    beside the models before it (those after it still on the host). Where no GPU takes
    even one layer, none. Moving layers to a GPU only frees host memory, so the host's
    budget does not bound the choice; the whole plan is then checked as usual."""
    out = list(configs)
    for i, (config, shape, cls) in enumerate(out):
        config, limit = cls.place(config, shape, room.gpus)
        out[i] = (config, shape, cls)
        option = cls.gpu_layers_option  # (no GPU: "auto" stays, and offloads nothing)
        if option is None or not limit or config.options.get(option, "auto") != "auto":
            continue

        def with_layers(n: int, config: ModelConfig = config,
                        option: str = option) -> ModelConfig:
            return attrs.evolve(config, options={**config.options, option: n})

        def gpus_fit(n: int, i: int = i, shape: ModelShape = shape,
                     cls: type[Backend] = cls, with_layers: Any = with_layers) -> bool:
            trial = list(out)
            trial[i] = (with_layers(n), shape, cls)
            return not _plan_for(trial, room, processes).gpus_over

        out[i] = (with_layers(_largest(gpus_fit, 0, limit) or 0), shape, cls)
    return out


def _placed_plan(configs: list[Entry], room: Room, processes: bool) -> Plan:
    return _plan_for(_placed(configs, room, processes), room, processes)


def uses_processes(manifest: Manifest, serving: bool) -> bool:
    """Whether the manifest's replicas run in processes of their own (worker processes or
    Ray actors): ``[cluster] engine``, and for "auto" whether ``laya serve`` runs it
    (``serving``) or code embeds it."""
    engine = manifest.cluster.engine
    return engine in ("process", "ray") or (engine == "auto" and serving)


def room_for(manifest: Manifest, machine: Machine | None = None) -> Room:
    """The budgets a manifest is planned against: this machine's, or ``machine``'s; the
    manifest's ``[memory]`` budgets win where set."""
    machine = machine or Machine()
    configured = manifest.memory.budget_bytes
    host = budget_mod.detect(configured) if machine.ram_bytes is None or configured \
        else budget_mod.for_ram(machine.ram_bytes)
    gpus = devices.detect() if machine.gpus is None else devices.given(machine.gpus)
    return Room(host, devices.with_configured(gpus, manifest.memory.gpu_budget))


def _device_problems(manifest: Manifest, registry: Registry, room: Room) -> Problems:
    """What the manifest asks of GPUs that the machine planned for lacks: a budget for a
    GPU it does not have, and each backend's own checks (``check_devices``), for this
    machine or the one ``--gpus`` describes."""
    problems = Problems()
    configured = manifest.memory.gpu_budget
    for device in configured if isinstance(configured, dict) else ():
        if device not in room.gpus.budgets:
            problems.add(f"memory.gpu_budget.{device}", "the machine has no such GPU (it "
                         f"has {', '.join(room.gpus.names) or 'none'})")
    for i, m in enumerate(manifest.models):
        key = f"models[{manifest.model_index.get(m.name, i)}]"
        for name, message in _backend_cls(registry, m).check_devices(m, room.gpus).items():
            problems.add(f"{key}.{name}", message)
    return problems


def make_plan(manifest: Manifest, registry: Registry, serving: bool = False,
              machine: Machine | None = None) -> Plan:
    """The plan of a resolved manifest (model paths are files or folders). ``serving``:
    planned as ``laya serve`` runs it (worker processes under ``[cluster] engine = "auto"``),
    rather than as a :class:`~laya_core.serving.deployment.Deployment` built in code.
    ``machine``: planned for another machine than this one."""
    processes = uses_processes(manifest, serving)
    room = room_for(manifest, machine)
    configs, problems = [], _device_problems(manifest, registry, room)
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
    # (Every model made it into configs: a problem raised above.)
    roomy = _placed_plan([(decide_sizes(m, shape, cls), shape, cls) for m, (_, shape, cls)
                          in zip(manifest.models, configs, strict=True)], room, processes)
    # Sized as a loaded engine sizes them: the default's 8 sequences where their KV is small
    # (ledger.default_num_seqs); where that plan does not fit, the fixed default's 4.
    if roomy.fits:
        return roomy
    placed = _placed(configs, room, processes)
    plan = _plan_for(placed, room, processes)
    if plan.fits:
        return plan
    return attrs.evolve(plan, suggestions=tuple(_suggestions(placed, room, processes)))


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

    def added(sized: ModelConfig) -> Plan:
        ledgers = _ledgers([(sized, shape, cls)], plan.processes)
        more = tuple(attrs.evolve(r, replica=first + i) for i, r in enumerate(ledgers))
        return attrs.evolve(plan, replicas=(*plan.replicas, *more), suggestions=())

    def with_it(sized: ModelConfig) -> Plan:
        sized, limit = cls.place(sized, shape, plan.gpus)
        option = cls.gpu_layers_option  # "auto": the most layers the GPUs still take
        if option is None or not limit or sized.options.get(option, "auto") != "auto":
            return added(sized)

        def layers(n: int) -> ModelConfig:
            return attrs.evolve(sized, options={**sized.options, option: n})

        return added(layers(_largest(lambda n: not added(layers(n)).gpus_over, 0, limit)
                            or 0))

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


def _suggestions(configs: list[Entry],
                 room: Room, processes: bool = False) -> list[str]:
    if not any(c[0].on_demand for c in configs):
        out = [line for i in range(len(configs))
               for line in _suggest_for(i, configs, room, processes)]
    else:  # the pinned models must fit together, and each on-demand one beside them
        pinned_at = [i for i, c in enumerate(configs) if not c[0].on_demand]
        pinned = [configs[i] for i in pinned_at]
        out = []
        if not _plan_for(pinned, room, processes).fits:
            for j, i in enumerate(pinned_at):
                out += _suggest_for(j, pinned, room, processes, f"models[{i}]")
        else:
            for i, entry in enumerate(configs):
                alone = [*pinned, entry]
                if entry[0].on_demand and not _plan_for(alone, room, processes).fits:
                    out += _suggest_for(len(alone) - 1, alone, room, processes,
                                        f"models[{i}]")
    if not out:
        out.append(f"nothing within these models fits {fmt_bytes(room.host.bytes)}"
                   + "".join(f" and {d}'s {fmt_bytes(room.gpus.budget_bytes(d))}"
                             for d in room.gpus.names)
                   + ": the weights and fixed overheads alone are too large; use a smaller or "
                   "more quantized model, or raise [memory] budget")
    return out


def _suggest_for(i: int, configs: list[Entry],
                 room: Room, processes: bool = False,
                 key: str | None = None) -> list[str]:
    """Settings of model i that make the plan fit, the others unchanged; ``key``: how the
    lines name the model (``models[i]``)."""
    config, shape, cls = configs[i]

    def fits_with(**changes: Any) -> bool:
        trial = list(configs)
        trial[i] = (attrs.evolve(config, **changes), shape, cls)
        return _plan_for(trial, room, processes).fits

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
    option = cls.gpu_layers_option  # fewer layers on the GPUs, the rest in host RAM
    layers = config.options.get(option) if option else None
    if option and type(layers) is int and layers > 0:
        n = _largest(lambda n: fits_with(options={**config.options, option: n}), 0, layers - 1)
        if n is not None:
            out.append(f"{key}.options.{option} = {n} (fewer layers on the GPU; the rest "
                       "run from host RAM)")
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
