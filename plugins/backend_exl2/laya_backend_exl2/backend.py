"""The ``exl2`` and ``exl3`` backends: what a manifest names, checks and plans.

Engine-level (laya_core/replica/engine_backend.py): the library's dynamic generator owns its
scheduling and its paged cache (pages of 256 tokens, which are also Laya's prefix blocks for
these models), and Laya keeps routing, validation, limits, metrics and the memory plan. The
plan is the library's cache and batch: ``kv_cache_tokens`` (rounded up to whole pages) is
the generator's cache, ``max_num_seqs`` its batch, ``max_step_tokens`` (rounded up to whole
pages) its prompt chunk, ``kv_cache_dtype`` its cache type ("f16", "q8", "q6", "q4").

Nothing here imports torch or the libraries but ``check_devices`` (torch only, where an
NVIDIA driver exists) and a replica's load (laya_backend_exl2/runtime.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from laya_backend_exl2 import options
from laya_backend_exl2.folder import folder_problem, read_config, read_folder
from laya_backend_exl2.host import cuda_problem
from laya_backend_exl2.memory import KV_DTYPES, memory_profile
from laya_backend_exl2.placement import auto_split, decided, placement
from laya_backend_exl2.runtime import Exl2Runtime, Exl3Runtime, Runtime, Settings
from laya_core.backend import MemoryProfile, ModelConfig
from laya_core.kv.dtypes import kv_bytes_per_token
from laya_core.models.checks import ModelFileError
from laya_core.models.files import ModelShape
from laya_core.replica.engine_backend import EngineBackend, EngineBackendClient

if TYPE_CHECKING:
    from laya_core.memory.devices import Gpus


class ExlBackend(EngineBackend):
    """What ``exl2`` and ``exl3`` share; a subclass names its library and formats.

    Options (``[models.options]``): ``device`` ("cuda:N", default "cuda:0") or
    ``gpu_split`` (GiB of weights per GPU from cuda:0, or "auto"); see options.py."""

    formats: ClassVar[tuple[str, ...]]
    runtime_cls: ClassVar[type[Runtime]]
    block_size = options.PAGE_TOKENS
    kv_cache_dtypes = KV_DTYPES
    option_names = frozenset(options.OPTIONS)
    # Below torch's 0: a GPTQ folder that names no backend runs on torch, which serves it on
    # a CPU as well; an EXL2 or EXL3 folder, which torch refuses (check_path), gets its
    # exllama. A manifest names backend = "exl2" to serve GPTQ through exllamav2.
    default_preference = -1

    @classmethod
    def check_option(cls, name: str, value: object) -> str | None:
        return options.check(name, value)

    @classmethod
    def check_options(cls, opts: dict[str, Any]) -> dict[str, str]:
        return options.check_together(opts)

    @classmethod
    def check_model_path(cls, path: str) -> str | None:
        return folder_problem(path, cls.formats, cls.name)

    @classmethod
    def check_devices(cls, config: ModelConfig, gpus: Gpus) -> dict[str, str]:
        # This machine's driver, torch and library; another machine's are not known here.
        problem = cuda_problem(cls.name, cls.runtime_cls.library) if gpus.local else None
        if problem is not None:
            return {"backend": problem + _cpu_hint(config)}
        have = ", ".join(gpus.names) or "none"
        for device in options.wanted_gpus(config.options):
            if device not in gpus.budgets:
                key = "options.gpu_split" if "gpu_split" in config.options else "options.device"
                return {key: f"{gpus.machine} has no {device} (its GPUs: {have})"}
        return {}

    @classmethod
    def place(cls, config: ModelConfig, shape: ModelShape,
              gpus: Gpus) -> tuple[ModelConfig, int]:
        """``gpu_split = "auto"`` made a list for ``gpus`` (none: left to the plan's check)."""
        if config.options.get("gpu_split") != "auto" or not gpus.names:
            return config, 0
        budgets = [gpus.budget_bytes(f"cuda:{i}")
                   for i in range(1 + max(options.device_index(d) or 0 for d in gpus.names))]
        return decided(config, auto_split(config, shape, read_folder(config.path), budgets)), 0

    @classmethod
    def memory_profile(cls, config: ModelConfig, shape: ModelShape) -> MemoryProfile:
        folder = read_folder(config.path)
        return memory_profile(config, shape, folder, placement(config, shape, folder),
                              cls.runtime_cls.library)

    def settings(self) -> Settings:
        """What a replica loads, as the plan decided it (laya serve hands the decided
        manifest on)."""
        config = self.config
        shape = self.model_shape(config.path)
        return Settings(
            path=config.path, max_seq_len=options.max_seq_len(config),
            max_num_seqs=options.max_num_seqs(config),
            chunk_tokens=options.chunk_tokens(config), pool_tokens=options.pool_tokens(config),
            kv_cache_dtype=config.kv_cache_dtype,
            placement=placement(config, shape, read_folder(config.path)),
            kv_bytes_per_token_per_layer=kv_bytes_per_token(
                shape, config.kv_cache_dtype, KV_DTYPES) // max(1, shape.n_layers))

    def engine_client(self, replica_id: int, index: int) -> EngineBackendClient:
        from laya_backend_exl2.client import ExlClient

        return ExlClient(self.config, replica_id, self.name, self.runtime_cls, self.settings)


def _cpu_hint(config: ModelConfig) -> str:
    """Where the model could be served on this machine instead, if anywhere."""
    try:
        qc = read_config(Path(config.path)).get("quantization_config")
    except ModelFileError:
        return ""  # the path's own check says what is wrong with it
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "gptq":
        return '; a GPTQ folder also runs on a CPU with backend = "torch"'
    return ""


class Exl2Backend(ExlBackend):
    """exllamav2 (its last release: 0.3.2): EXL2 and GPTQ folders."""

    name = "exl2"
    formats = ("exl2", "gptq")
    runtime_cls = Exl2Runtime


class Exl3Backend(ExlBackend):
    """exllamav3, exllamav2's maintained successor: EXL3 folders."""

    name = "exl3"
    formats = ("exl3",)
    runtime_cls = Exl3Runtime
