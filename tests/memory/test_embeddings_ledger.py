"""The memory the embeddings need is its own ledger line, and the line holds what each
backend allocates for them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from laya_backend_llamacpp import memory as llama_memory
from laya_backend_torch import memory as torch_memory
from laya_backend_torch.backend import TorchBackend

from laya_core.backend import ModelConfig
from laya_core.builtin.model_paths import embedded_file
from laya_core.memory.ledger import sizes_for
from laya_core.models.files import read_shape

pytestmark = pytest.mark.model
MIB = 2**20


def config(backend: str) -> ModelConfig:
    return sizes_for(ModelConfig(name="smollm2", backend=backend,
                                 path=embedded_file("smollm2-135m-instruct"),
                                 max_seq_len=1024, max_num_seqs=2, embeddings=True,
                                 options={"n_threads": 1}), 8192)


def line(profile_of: object, cfg: ModelConfig) -> int:
    profile = profile_of(cfg, read_shape(cfg.path))  # type: ignore[operator]
    (bytes_,) = [o.bytes for o in profile.overheads if o.name == "embeddings"]
    return int(bytes_)


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture
def torch_threads() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_laya_plan_shows_the_line_only_where_embeddings_are_on(tmp_path: Path) -> None:
    def plan(extra: str) -> str:
        manifest = tmp_path / "laya.toml"
        manifest.write_text('[[models]]\nname = "smol"\npath = "embedded:smollm2-135m-instruct"'
                            f"\n{extra}")
        return subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", str(manifest)],
                              capture_output=True, text=True, check=True).stdout

    assert "  embeddings " in plan("embeddings = true\n")
    assert "  embeddings " not in plan("")  # generation alone pays nothing for them


# Run in a fresh process: in one that freed llama.cpp contexts before (earlier tests), the
# allocator hands that memory back without the RSS growing, and the line would read as 0.
_MEASURE_CONTEXT = """
import sys
sys.path.insert(0, {tests!r})
from test_embeddings_ledger import config, resident
from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_core.engine.embed_jobs import EmbedChunk, EmbedPlan

backend = LlamaCppBackend(config("llamacpp"))
backend.load_weights()
backend.allocate_cache(n_ctx=2048, max_num_seqs=2)
backend.allocate_embedder()
backend.embed(list(range(100, 1124)))  # the weights' pages in, through this first context
first = backend._embedder
backend._embedder = None  # kept open beside the second
before = resident()
backend.allocate_embedder()  # a second one beside it: what one context costs
backend.embed(list(range(200, 1224)))
# and a batch of one-token inputs, each a sequence of its own, as many as it takes at once
backend.embed_step(EmbedPlan(tuple(EmbedChunk(s, (300 + s,), 0, True)
                                   for s in range(backend.max_embed_inputs))))
print(resident() - before)
first.close()
backend.close()
"""


def test_llamacpp_embedding_context_is_what_the_line_says() -> None:
    """The context's RSS, measured once it has embedded a full-length input and a batch
    of one-token inputs (weights already resident), within 10% of the line: 75 MiB at
    max_seq_len 1024 (AMD EPYC)."""
    cfg = config("llamacpp")
    script = _MEASURE_CONTEXT.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    grown = int(out.stdout.strip().splitlines()[-1])
    planned = line(llama_memory.memory_profile, cfg)
    assert abs(grown - planned) <= 0.1 * planned, (grown / MIB, planned / MIB)


@pytest.mark.usefixtures("torch_threads")
def test_torch_embedding_scratch_is_what_the_line_says() -> None:
    cfg = config("torch")
    backend = TorchBackend(cfg)
    backend.load_weights()
    backend.allocate_kv(num_tokens=2048, max_num_seqs=2)
    try:
        assert backend._embed_pool.nbytes == line(torch_memory.memory_profile, cfg)
    finally:
        backend.close()
