"""One model of a manifest against the installed plugins (``manifest.resolve``'s part per
model): its backend chosen where the manifest names none, its ``SCHEME:NAME`` path made a
file, and its backend, scheduler, cache policy, KV type, options and file checked. Every
problem names its key (``models[0].kv_cache_dtype``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from laya_core.backend import ModelConfig
from laya_core.config.table import ManifestError, Problems
from laya_core.kv.dtypes import kv_dtype_problems
from laya_core.models.checks import ModelFileError
from laya_core.models.files import model_file_problem

AUTO_BACKEND = "auto"  # a model's backend when the manifest names none: see default_backend
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:(?!//)")  # embedded:NAME, not a URL


def _check_layout(backend: Any, m: ModelConfig, i: int, registry: Any,
                  problems: Problems) -> None:
    """A cache policy named in the manifest must serve the backend's KV layout."""
    policy = registry.cache_policies.get(m.cache_policy)
    if m.cache_policy == "auto":
        fitting = [n for n, e in registry.cache_policies.items()
                   if e.obj.layout == backend.kv_layout]
        if not fitting:
            problems.add(f"models[{i}].cache_policy",
                         f"no installed cache policy serves the {backend.kv_layout} KV layout "
                         f"of the {m.backend} backend; install the plugin that ships one")
    elif policy is not None and policy.obj.layout != backend.kv_layout:
        problems.add(f"models[{i}].cache_policy",
                     f"{m.cache_policy!r} serves the {policy.obj.layout} KV layout, the "
                     f"{m.backend} backend has the {backend.kv_layout} layout; leave it "
                     "\"auto\" or name a policy for that layout")


def default_backend(registry: Any, path: str) -> str | None:
    """The backend a model without ``backend`` gets: of the installed backends that take
    ``path`` (``check_model_path``), else of all installed, the one with the highest
    ``default_preference``, ties by name; None when no backend is installed."""
    names = sorted(registry.backends)
    taking = [n for n in names if registry.backends[n].obj.check_model_path(path) is None]
    return max(taking or names, key=lambda n: registry.backends[n].obj.default_preference,
               default=None)


def _resolved_path(m: ModelConfig, i: int, registry: Any) -> str:
    """The model's path with a ``SCHEME:NAME`` path turned into a file by its plugin."""
    try:
        resolved = registry.resolve_model_path(m.path)
    except LookupError as e:
        raise ManifestError(f"models[{i}].path", str(e)) from e
    if resolved is None and (scheme := SCHEME_RE.match(m.path)) \
            and not Path(m.path).exists():
        raise ManifestError(f"models[{i}].path", f"no installed plugin resolves "
                            f"{scheme.group(0)} paths (the resolve_model_path hook); install "
                            "the one that does, or give a file path")
    return resolved or m.path


def resolve_model(m: ModelConfig, i: int, registry: Any, need_backends: bool,
                   problems: Problems) -> ModelConfig:
    path_error = None  # raised after the plugin checks, so their problems show with it
    try:
        path = _resolved_path(m, i, registry)
    except ManifestError as e:
        path, path_error = m.path, e
    if m.backend == AUTO_BACKEND:
        default = default_backend(registry, path)
        if default is None and need_backends:
            failed = "; ".join(str(f) for f in getattr(registry, "failures", ()))
            raise ManifestError(f"models[{i}].backend", "no backend is installed to run "
                                "this model; install a backend plugin (`laya plugins` lists "
                                "what is installed)" + (f". Left out: {failed}" if failed else ""))
        m = attrs.evolve(m, backend=default or m.backend)
    for key, family in (("backend", registry.backends), ("scheduler", registry.schedulers),
                        ("cache_policy", registry.cache_policies)):
        chosen = getattr(m, key)
        if key == "backend" and not need_backends:
            continue
        if chosen not in family and not (key == "cache_policy" and chosen == "auto"):
            known = ", ".join(sorted(family)) or "none"
            failed = "; ".join(str(f) for f in getattr(registry, "failures", ()))
            problems.add(f"models[{i}].{key}",
                         f"no {key.replace('_', ' ')} {chosen!r} is installed "
                         f"(installed: {known}); install its plugin or fix the name"
                         + (f". Left out, perhaps the one: {failed}" if failed else ""))
    backend = registry.backends.get(m.backend)
    if backend and (broken := kv_dtype_problems(backend.obj.kv_cache_dtypes)):
        problems.add(f"models[{i}].backend", f"the {m.backend} backend's kv_cache_dtypes "
                     f"are wrong: {'; '.join(broken)} (a bug of its plugin)")
    elif backend and m.kv_cache_dtype not in backend.obj.kv_cache_dtypes:
        problems.add(f"models[{i}].kv_cache_dtype",
                     f"the {m.backend} backend cannot store a {m.kv_cache_dtype!r} KV "
                     f"cache; its KV types are {', '.join(backend.obj.kv_cache_dtypes)}")
    if backend and m.kv_cache_tokens is not None and m.kv_cache_tokens < backend.obj.block_size:
        problems.add(f"models[{i}].kv_cache_tokens",
                     f"{m.kv_cache_tokens} tokens are less than one KV block of the "
                     f"{m.backend} backend ({backend.obj.block_size} tokens)")
    if backend and m.embeddings and not backend.obj.supports_embeddings:
        problems.add(f"models[{i}].embeddings",
                     f"the {m.backend} backend cannot compute embeddings; remove the key")
    if backend and m.speculative is not None and not backend.obj.supports_speculative:
        if m.speculative.auto:  # the default asks nothing of a backend
            m = attrs.evolve(m, speculative=None)
        else:
            problems.add(f"models[{i}].speculative",
                         f"the {m.backend} backend does not verify drafts (speculative "
                         "decoding); remove the key")
    lora_keys = [k for k in ("lora", "max_loras") if getattr(m, k)]
    if backend and lora_keys and not backend.obj.supports_lora:
        problems.add(f"models[{i}].{lora_keys[0]}", f"the {m.backend} backend does not "
                     "apply LoRA adapters; remove the key, or serve the model with a backend "
                     "that does (torch, llamacpp)")
    if backend and need_backends:
        _check_options(backend.obj, m, i, problems)
        _check_layout(backend.obj, m, i, registry, problems)
    if path_error is not None:
        raise path_error
    needs_file = backend is None or backend.obj.needs_model_file  # not installed: as a file
    check = backend.obj.check_model_metadata if backend else None
    if needs_file and (problem := model_file_problem(path, check)):
        raise ManifestError(f"models[{i}].path", problem)
    if backend and need_backends and (problem := backend.obj.check_model_path(path)):
        raise ManifestError(f"models[{i}].path", problem)
    if m.lora and backend and backend.obj.supports_lora:
        _check_adapters(backend.obj, m, path, i, problems)
    spec = m.speculative
    if spec is not None and spec.method == "draft" and spec.model is not None:
        # Resolved for laya plan too, which makes its plan without the backends' checks.
        try:
            draft: str | None = _resolved_path(attrs.evolve(m, path=spec.model), i, registry)
        except ManifestError as e:
            problems.add(f"models[{i}].speculative.model", e.message)
            draft = None
        if backend and need_backends:
            _check_draft(backend.obj, m, path, draft, i, problems)
        if draft is not None:
            m = attrs.evolve(m, speculative=attrs.evolve(spec, model=draft))
    return attrs.evolve(m, path=path)


def _check_draft(backend_cls: Any, m: ModelConfig, path: str, draft: str | None, i: int,
                 problems: Problems) -> None:
    """The backend runs a draft model; the draft's file (``draft``, resolved; None where it
    could not be) is one the backend loads, and its vocabulary the model's size (the tokens
    themselves are compared when it loads)."""
    if not backend_cls.supports_draft_model:
        problems.add(f"models[{i}].speculative.method", f"the {m.backend} backend runs no "
                     'draft model; use method = "ngram", or the llamacpp or torch backend')
        return
    if draft is None:
        return
    problem = model_file_problem(draft, backend_cls.check_model_metadata) or \
        backend_cls.check_model_path(draft)
    if problem is None:
        try:
            want, got = (backend_cls.model_shape(p).vocab_size for p in (path, draft))
        except (ModelFileError, OSError, ValueError) as e:
            problem = str(e)
        else:
            if want != got:
                problem = (f"its vocabulary has {got} tokens, the model's {want}: a draft "
                           "model must share the model's tokenizer")
    if problem is not None:
        problems.add(f"models[{i}].speculative.model", problem)


def _check_adapters(backend_cls: Any, m: ModelConfig, path: str, i: int,
                    problems: Problems) -> None:
    """Each LoRA adapter reads as one of this model's shape, in the backend's format."""
    from laya_core.models.lora import AdapterError

    try:
        shape = backend_cls.model_shape(path)
    except (ModelFileError, OSError, ValueError):
        shape = None  # the path's own problem is said where the plan reads it
    for name, folder in m.lora.items():
        try:
            adapter = backend_cls.read_adapter(folder, shape)
        except AdapterError as e:
            problems.add(f"models[{i}].lora.{name}", str(e))
            continue
        if m.max_lora_rank is not None and adapter.rank > m.max_lora_rank:
            problems.add(f"models[{i}].lora.{name}", f"its rank {adapter.rank} is above "
                         f"max_lora_rank ({m.max_lora_rank}); raise max_lora_rank")


def _check_options(backend_cls: Any, m: ModelConfig, i: int, problems: Problems) -> None:
    """The options suit the chosen backend."""
    before = len(problems.found)
    for name in m.options:
        if name not in backend_cls.option_names:
            known = ", ".join(sorted(backend_cls.option_names)) or "none"
            problems.add(f"models[{i}].options.{name}",
                         f"the {m.backend} backend has no option {name!r}; its "
                         f"options are: {known}")
        elif problem := backend_cls.check_option(name, m.options[name]):
            problems.add(f"models[{i}].options.{name}", problem)
    if len(problems.found) == before:  # each value fine alone: do they go together?
        for name, problem in backend_cls.check_options(m.options).items():
            problems.add(f"models[{i}].options.{name}", problem)
