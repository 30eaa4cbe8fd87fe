"""The libraries themselves, behind one small interface: the only module that imports torch,
exllamav2 or exllamav3, and only in ``load``.

Both libraries have a dynamic generator over a paged cache: jobs are enqueued with their
prompt's token ids, sampling settings and stop tokens; each ``iterate()`` runs one forward
pass over every active job (prompt chunks and one token each for the decoding ones) and
returns a list of result dicts (``stage`` "started", "prefill" or "streaming"; the tokens
released so far in ``token_ids``; at the end ``eos`` with ``eos_reason``, and the tokens
still held back in ``held``). :class:`Runtime` hands those on as :class:`Output` objects.

exllamav2's names are read from its sources (turboderp-org/exllamav2, generator/dynamic.py,
0.3.2); exllamav3's from its sources too (generator/generator.py, job.py, cache/), but
this adapter has not yet run against either on a GPU (tools/gpu_check.sh runs it).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from laya_backend_exl2.options import PAGE_TOKENS
from laya_backend_exl2.placement import Placement
from laya_core.types import SamplingParams

log = logging.getLogger(__name__)
# The generator's reasons to end a job that mean "cut short by a length" (the rest: "stop").
LENGTH_REASONS = frozenset({"max_new_tokens"})


@attrs.frozen
class Settings:
    """What one replica loads: the folder and the sizes the plan decided."""

    path: str
    max_seq_len: int
    max_num_seqs: int
    chunk_tokens: int  # tokens per forward pass: a multiple of the page
    pool_tokens: int  # the cache: a multiple of the page
    kv_cache_dtype: str  # "f16", "q8", "q6" or "q4"
    placement: Placement
    kv_bytes_per_token_per_layer: int


@attrs.frozen
class Output:
    """What one iteration produced for one request."""

    rid: int
    started: bool = False  # the job got its pages and runs
    token_ids: tuple[int, ...] = ()
    end: str | None = None  # the generator ended the job, for this reason
    cached_tokens: int = 0  # prompt tokens whose KV came from the generator's page cache


def _ids(value: Any) -> tuple[int, ...]:
    """A result's tensor of token ids, shape (1, n), as a tuple."""
    return () if value is None else tuple(int(t) for t in value.flatten().tolist())


class Runtime:
    """One loaded model and its generator; used from one thread only (the client's)."""

    library: ClassVar[str]

    def __init__(self, generator: Any, version: str) -> None:
        self.generator = generator
        self.version = version
        self._jobs: dict[int, Any] = {}

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        raise NotImplementedError

    def new_job(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                stops: Sequence[int]) -> Any:
        raise NotImplementedError

    def enqueue(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                stops: Sequence[int]) -> None:
        job = self.new_job(rid, prompt, params, stops)
        self.generator.enqueue(job)
        self._jobs[rid] = job

    def cancel(self, rid: int) -> int:
        """Drop a job (no more outputs come for it); the prompt tokens it found cached."""
        job = self._jobs.pop(rid, None)
        if job is None:
            return 0
        self.generator.cancel(job)
        return int(getattr(job, "cached_pages", 0)) * PAGE_TOKENS + int(
            getattr(job, "cached_tokens", 0))

    def has_work(self) -> bool:
        return bool(self._jobs)

    def iterate(self) -> list[Output]:
        out = []
        for r in self.generator.iterate():
            rid = r.get("identifier")
            if rid not in self._jobs:
                continue  # cancelled meanwhile
            if r.get("stage") == "started":
                out.append(Output(rid, started=True))
            elif r.get("stage") == "streaming":
                held = r.get("held") or {}
                tokens = _ids(r.get("token_ids")) + _ids(held.get("token_ids"))
                end = r.get("eos_reason", "stop") if r.get("eos") else None
                if end is not None:
                    del self._jobs[rid]
                out.append(Output(rid, token_ids=tokens, end=end,
                                  cached_tokens=int(r.get("cached_tokens") or 0)))
        return out

    def close(self) -> None:
        """Free the model, its cache and their GPU memory."""
        for rid in list(self._jobs):
            self.cancel(rid)
        unload = getattr(self.generator.model, "unload", None)
        if unload is not None:
            unload()
        self.generator = None
        gc.collect()
        import torch

        torch.cuda.empty_cache()


class Exl2Runtime(Runtime):
    """exllamav2: ExLlamaV2Config, ExLlamaV2, a cache of the KV type, the dynamic generator
    in paged mode (flash-attn), its jobs with ExLlamaV2Sampler.Settings."""

    library = "exllamav2"
    _CACHES = {"f16": "ExLlamaV2Cache", "q8": "ExLlamaV2Cache_Q8", "q6": "ExLlamaV2Cache_Q6",
               "q4": "ExLlamaV2Cache_Q4"}

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        import exllamav2
        import torch
        from exllamav2 import attn
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        torch.cuda.set_device(settings.placement.devices[0])
        config = exllamav2.ExLlamaV2Config(settings.path)
        config.max_seq_len = settings.max_seq_len
        # One chunk per forward pass; its attention matrix is chunk x chunk at most.
        config.max_input_len = settings.chunk_tokens
        config.max_attention_size = settings.chunk_tokens ** 2
        model = exllamav2.ExLlamaV2(config)
        # The plan's split: GiB of weights and scratch per GPU from cuda:0 (0: none).
        model.load(gpu_split=settings.placement.split_gib())
        cache = getattr(exllamav2, cls._CACHES[settings.kv_cache_dtype])(
            model, max_seq_len=settings.pool_tokens)
        # Paged attention (a batch of requests over shared pages) is flash-attn's (2.5.7 or
        # later); without it the generator runs one request at a time over the whole cache,
        # and the others wait in its queue.
        paged = bool(attn.has_flash_attn_with_paged)
        generator = ExLlamaV2DynamicGenerator(
            model=model, cache=cache, tokenizer=exllamav2.ExLlamaV2Tokenizer(config),
            max_batch_size=settings.max_num_seqs if paged else 1,
            max_seq_len=settings.max_seq_len, max_chunk_size=settings.chunk_tokens,
            max_q_size=1, paged=paged)
        version = f"exllamav2 {exllamav2.__version__}"
        if not paged:
            log.warning("%s: no flash-attn 2.5.7 or later, so no paged attention: the "
                        "generator runs one request at a time", settings.path)
            version += " (unpaged: one request at a time, no flash-attn)"
        return cls(generator, version)

    def new_job(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                stops: Sequence[int]) -> Any:
        import torch
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        s = ExLlamaV2Sampler.Settings()  # its defaults sample (0.8, top-k 50): all set here
        s.token_repetition_penalty = params.repetition_penalty
        s.token_frequency_penalty = params.frequency_penalty
        s.token_presence_penalty = params.presence_penalty
        s.temperature = 1.0 if params.greedy else params.temperature
        s.top_k = 1 if params.greedy else params.top_k  # 0: off
        s.top_p = 0.0 if params.greedy else params.top_p  # 0 or 1: off
        s.min_p = 0.0 if params.greedy else params.min_p
        return ExLlamaV2DynamicJob(
            input_ids=torch.tensor([list(prompt)], dtype=torch.long),
            max_new_tokens=params.max_tokens, gen_settings=s, seed=params.seed,
            stop_conditions=list(stops) or None, token_healing=False, identifier=rid)


class Exl3Runtime(Runtime):
    """exllamav3: Config, Model, Cache (fp16 or quantized layers), Generator and its Jobs
    with a ComboSampler."""

    library = "exllamav3"
    _BITS = {"q8": 8, "q6": 6, "q4": 4}

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        import exllamav3
        import torch

        torch.cuda.set_device(settings.placement.devices[0])
        config = exllamav3.Config.from_directory(settings.path)
        model = exllamav3.Model.from_config(config)
        bits = cls._BITS.get(settings.kv_cache_dtype)
        layers: dict[str, Any] = {} if bits is None else {
            "layer_type": exllamav3.CacheLayer_quant, "k_bits": bits, "v_bits": bits}
        # Attached before the load, which allocates each layer's cache on the layer's GPU.
        cache = exllamav3.Cache(model, max_num_tokens=settings.pool_tokens,
                                max_batch_size=settings.max_num_seqs, **layers)
        place = settings.placement
        if len(place.devices) == 1:
            model.load(device=place.devices[0])
        else:  # GiB per GPU with its layers' cache: exllamav3 counts the cache in
            model.load(use_per_device=place.split_gib(
                settings.kv_bytes_per_token_per_layer, settings.pool_tokens))
        generator = exllamav3.Generator(
            model=model, cache=cache, tokenizer=exllamav3.Tokenizer.from_config(config),
            max_batch_size=settings.max_num_seqs, max_chunk_size=settings.chunk_tokens)
        return cls(generator, f"exllamav3 {getattr(exllamav3, '__version__', '?')}")

    def new_job(self, rid: int, prompt: Sequence[int], params: SamplingParams,
                stops: Sequence[int]) -> Any:
        import exllamav3
        import torch

        sampler = exllamav3.ComboSampler(
            rep_p=params.repetition_penalty, freq_p=params.frequency_penalty,
            pres_p=params.presence_penalty, temperature=params.temperature,
            min_p=params.min_p, top_k=params.top_k, top_p=params.top_p)
        return exllamav3.Job(
            input_ids=torch.tensor([list(prompt)], dtype=torch.long),
            max_new_tokens=params.max_tokens, sampler=sampler, seed=params.seed,
            stop_conditions=list(stops) or None, token_healing=False, identifier=rid)
