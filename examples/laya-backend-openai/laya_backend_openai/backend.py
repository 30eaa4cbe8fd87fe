"""The ``openai`` backend: what a manifest names, checks and plans.

Each replica of the model is one upstream server, reached by its OpenAI base URL::

    [[models]]
    name = "chat"
    backend = "openai"
    path = "http://10.0.0.5:8080/v1"      # replica 0's server
    replicas = 2
    max_seq_len = 16384                    # prompt bytes + max_tokens (the length rule)
    [models.options]
    upstreams = ["http://10.0.0.5:8080/v1", "http://10.0.0.6:8080/v1"]   # replica i: item i
    model = "qwen2.5-7b-instruct"          # the name the servers serve; default: their first
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlsplit

from laya_core.backend import MemoryProfile, ModelConfig, Overhead
from laya_core.models.files import ModelShape
from laya_core.replica.engine_backend import EngineBackend, EngineBackendClient

# A prompt counts in bytes here (laya_backend_openai/text.py): the most a manifest may allow.
MAX_PROMPT_BYTES = 1 << 20
_SECONDS = ("timeout_s", "connect_timeout_s", "health_interval_s")


def url_problem(url: object) -> str | None:
    if not isinstance(url, str):
        return f"{url!r} is not a URL"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"{url!r} is not an http:// or https:// URL (the server's base, such as " \
               "http://host:8080/v1)"
    return None


class OpenAIBackend(EngineBackend):
    """Any OpenAI-compatible server as a model's replica; see the module docstring."""

    name = "openai"
    needs_model_file = False
    block_size = 64  # bytes: about 16 tokens of text, the router's prefix blocks
    option_names: ClassVar[frozenset[str]] = frozenset(
        {"upstreams", "model", *_SECONDS, "api_key"})

    @classmethod
    def check_model_path(cls, path: str) -> str | None:
        return url_problem(path)

    @classmethod
    def check_option(cls, name: str, value: object) -> str | None:
        if name == "upstreams":
            if not isinstance(value, list) or not value:
                return "must be a list of the servers' base URLs, one a replica"
            return next((p for p in map(url_problem, value) if p), None)
        if name in ("model", "api_key"):
            return None if isinstance(value, str) and value else "must be a non-empty string"
        if name in _SECONDS:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            return None if ok else "must be a positive number of seconds"
        return None

    @classmethod
    def model_shape(cls, path: str) -> ModelShape:
        # Nothing of the model lives here: no weights, no KV cache.
        return ModelShape(architecture="openai-upstream", n_layers=0, n_heads=0,
                          n_kv_heads=0, head_dim_k=0, head_dim_v=0, hidden_size=0,
                          vocab_size=256, n_ctx_train=MAX_PROMPT_BYTES, weights_bytes=0,
                          weights_source="held by the upstream servers")

    @classmethod
    def memory_profile(cls, config: ModelConfig, shape: ModelShape) -> MemoryProfile:
        buffers = 4 << 20
        return MemoryProfile(
            weights_bytes=0, weights_source=shape.weights_source, kv_bytes_per_token=0,
            kv_dtype=config.kv_cache_dtype,
            overheads=(Overhead("upstream client", buffers,
                                "estimate: an HTTP connection pool and its buffers"),))

    def upstream(self, index: int) -> str:
        """The server of the model's ``index``-th replica: that item of ``upstreams`` (round
        the list, where replicas outnumber it), else the path."""
        upstreams: list[str] = self.config.options.get("upstreams") or [self.config.path]
        return upstreams[index % len(upstreams)].rstrip("/")

    def engine_client(self, replica_id: int, index: int) -> EngineBackendClient:
        from laya_backend_openai.client import UpstreamClient

        options: dict[str, Any] = self.config.options
        return UpstreamClient(self.config, replica_id, self.upstream(index),
                              model=options.get("model"),
                              timeout_s=float(options.get("timeout_s", 60.0)),
                              connect_timeout_s=float(options.get("connect_timeout_s", 5.0)),
                              health_interval_s=float(options.get("health_interval_s", 2.0)),
                              api_key=options.get("api_key"))
