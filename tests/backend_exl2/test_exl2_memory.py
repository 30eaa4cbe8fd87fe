"""The ExLlama memory profile: every byte on a device. The weights but the token embedding,
the KV cache, scratch and a CUDA context on the GPUs the options name; the embedding, CUDA
torch with the library, the tokenizers and the sampled logits in host RAM. The cache types
priced per 32 elements with their scales, the pool in whole 256-token pages, a split over
several GPUs following the layers, and the plan made for a machine with GPUs (--gpus)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from exl2_folders import HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, write_exl2_folder
from laya_backend_exl2.backend import Exl2Backend, Exl3Backend
from laya_backend_exl2.folder import read_folder
from laya_backend_exl2.memory import RUNTIME_HOST_BYTES
from laya_backend_exl2.options import chunk_tokens

from laya_core.backend import MemoryProfile, ModelConfig
from laya_core.config import manifest as mf
from laya_core.memory import planner, report
from laya_core.memory.devices import CUDA_CONTEXT_BYTES
from laya_core.models.files import read_shape
from laya_core.plugins import load_registry

GIB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_exl2_folder(tmp_path_factory.mktemp("exl2") / "m")


def config(folder: Path, **fields: Any) -> ModelConfig:
    """A model's config with its sizes decided, as the plan hands it to memory_profile."""
    sizes = {"max_seq_len": 1024, "max_num_seqs": 2, "kv_cache_tokens": 2048}
    return ModelConfig(name="m", backend="exl2", path=str(folder), **{**sizes, **fields})


def profile(folder: Path, **fields: Any) -> MemoryProfile:
    return Exl2Backend.memory_profile(config(folder, **fields), read_shape(folder))


def lines(p: MemoryProfile) -> dict[str, tuple[int, str]]:
    return {o.name: (o.bytes, o.device) for o in p.overheads}


def test_the_shape_is_read_from_a_quantized_folder(folder: Path) -> None:
    """EXL2 tensors (*.q_weight, int32) have no dense shape; their bytes are the headers'."""
    shape, f = read_shape(folder), read_folder(folder)
    assert (shape.n_layers, shape.hidden_size, shape.n_kv_heads) == (LAYERS, HIDDEN, KV_HEADS)
    assert shape.weights_bytes == f.weights_bytes == sum(
        f.layer_bytes) + f.embedding_bytes + f.head_bytes
    assert f.embedding_bytes == shape.vocab_size * HIDDEN * 2  # fp16, kept in host RAM
    assert len(set(f.layer_bytes)) == 1 and f.has_head


def test_one_gpu_holds_all_but_the_embedding(folder: Path) -> None:
    p, f = profile(folder), read_folder(folder)
    kv_per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V in fp16
    assert p.kv_bytes_per_token == kv_per_token and p.kv_dtype == "f16"
    assert p.weights_on == {"cuda:0": f.weights_bytes - f.embedding_bytes}
    assert p.kv_bytes_per_token_on == {"cuda:0": kv_per_token}
    got = lines(p)
    assert got["CUDA context cuda:0"] == (CUDA_CONTEXT_BYTES, "cuda:0")
    assert got["generator scratch cuda:0"][1] == "cuda:0"
    assert got["exllamav2 runtime"] == (RUNTIME_HOST_BYTES, "cpu")
    assert got["vocabulary"][1] == got["sampled logits"][1] == "cpu"
    assert not [n for n in got if n.startswith(("KV pages", "KV dequantization", "output"))]
    shared = {o.name: o.shared for o in p.overheads if o.shared}
    assert shared == {"CUDA context cuda:0": "cuda context", "exllamav2 runtime": "exllamav2"}


def test_the_scratch_grows_with_the_chunk_and_the_batch(folder: Path) -> None:
    base = lines(profile(folder))["generator scratch cuda:0"][0]
    assert lines(profile(folder, max_step_tokens=2048))["generator scratch cuda:0"][0] > base
    assert lines(profile(folder, max_num_seqs=8, kv_cache_tokens=8192))[
        "generator scratch cuda:0"][0] > base
    # The library's chunk: max_step_tokens in whole pages, at least a token per sequence.
    assert chunk_tokens(config(folder, max_step_tokens=300)) == 512
    assert chunk_tokens(config(folder, max_step_tokens=64, max_num_seqs=300)) == 512


@pytest.mark.parametrize(("dtype", "group_bytes"), [("q8", 34), ("q6", 26), ("q4", 18)])
def test_quantized_caches_are_priced_with_their_scales(folder: Path, dtype: str,
                                                       group_bytes: int) -> None:
    p = profile(folder, kv_cache_dtype=dtype)
    groups = KV_HEADS * HEAD_DIM // 32  # of 32 elements, per K or V row
    assert p.kv_bytes_per_token == LAYERS * 2 * groups * group_bytes
    # exllamav2 attends from an fp16 copy of one layer's whole cache.
    assert lines(p)["KV dequantization cuda:0"] == (2048 * 2 * KV_HEADS * HEAD_DIM * 2,
                                                     "cuda:0")


def test_the_pool_is_rounded_up_to_whole_pages(folder: Path) -> None:
    p = profile(folder, kv_cache_tokens=1000)
    assert lines(p)["KV pages cuda:0"] == (24 * p.kv_bytes_per_token, "cuda:0")


def test_device_moves_everything_gpu_side(folder: Path) -> None:
    p = profile(folder, options={"device": "cuda:1"})
    assert set(p.weights_on) == set(p.kv_bytes_per_token_on) == {"cuda:1"}
    assert {o.device for o in p.overheads} == {"cuda:1", "cpu"}


def test_a_split_follows_the_layers(folder: Path) -> None:
    """Shares too small for the whole model: the layers fill cuda:0, then cuda:1, whose
    last GPU takes the rest and the head; each layer's KV is where the layer is."""
    f = read_folder(folder)
    scratch = lines(profile(folder))["generator scratch cuda:0"][0]
    share = (scratch + f.layer_bytes[0] + 100) / GIB  # room for one layer
    p = profile(folder, options={"gpu_split": [share, share]})
    per_layer = p.kv_bytes_per_token // LAYERS
    assert p.kv_bytes_per_token_on == {"cuda:0": per_layer, "cuda:1": 2 * per_layer}
    assert p.weights_on == {"cuda:0": f.layer_bytes[0],
                            "cuda:1": f.layer_bytes[1] + f.layer_bytes[2] + f.head_bytes}
    got = lines(p)
    assert got["CUDA context cuda:0"][1] == "cuda:0" and got["CUDA context cuda:1"][1] == "cuda:1"
    # The logits are the head's GPU's.
    assert got["generator scratch cuda:1"][0] > got["generator scratch cuda:0"][0]
    # Ample shares: all on the first GPU, none on the second.
    assert set(profile(folder, options={"gpu_split": [20, 20]}).weights_on) == {"cuda:0"}


def test_a_tied_head_is_copied_to_the_gpu(tmp_path: Path) -> None:
    folder = write_exl2_folder(tmp_path / "tied", tied=True)
    shape = read_shape(folder)
    assert lines(profile(folder))["output head cuda:0"] == (
        shape.vocab_size * HIDDEN * 2, "cuda:0")


def test_exl3_counts_its_own_library(tmp_path: Path) -> None:
    folder = write_exl2_folder(tmp_path / "e3", method="exl3")
    p = Exl3Backend.memory_profile(attrs.evolve(config(folder), backend="exl3"),
                                   read_shape(folder))
    assert "exllamav3 runtime" in lines(p)


def test_a_plan_for_a_machine_with_two_gpus_splits_auto_by_their_budgets(folder: Path) -> None:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"models": [{
        "name": "m", "backend": "exl2", "path": str(folder), "max_seq_len": 1024,
        "max_num_seqs": 2, "options": {"gpu_split": "auto"}}]}), registry)
    plan = planner.make_plan(manifest, registry,
                             machine=planner.Machine(gpus=(24 * GIB, 24 * GIB)))
    assert plan.fits, report.format_plan(plan)
    (replica,) = plan.replicas
    split = replica.config.options["gpu_split"]
    assert isinstance(split, list) and len(split) == 2 and split[0] == split[1]
    assert replica.gpus == ("cuda:0", "cuda:1")  # half the weights each
    assert 0 < plan.gpu_bytes("cuda:1") and CUDA_CONTEXT_BYTES < plan.gpu_bytes("cuda:0")
    # The decided list is what a replica loads, and what the manifest's checks take.
    decided = planner.decided_manifest(manifest, plan).models[0]
    assert decided.options["gpu_split"] == split
    assert Exl2Backend.check_option("gpu_split", split) is None
