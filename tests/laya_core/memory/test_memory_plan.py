"""The ledger from headers: model shapes, KV arithmetic, budgets, suggestions."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from laya_core.builtin.model_paths import embedded_file
from laya_core.config import manifest as mf
from laya_core.kv.dtypes import kv_bytes_per_token
from laya_core.memory import budget as budget_mod
from laya_core.memory import planner, report
from laya_core.models.files import ModelFileError, read_shape
from laya_core.plugins import load_registry

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
            "torch_dtype": "float16", "tie_word_embeddings": False}


def hf_folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_gguf_shape_of_the_embedded_model() -> None:
    shape = read_shape(embedded_file("smollm2-135m-instruct"))
    assert (shape.architecture, shape.n_layers, shape.n_heads, shape.n_kv_heads) == \
        ("llama", 30, 9, 3)
    assert (shape.head_dim_k, shape.hidden_size, shape.vocab_size, shape.n_ctx_train) == \
        (64, 576, 49152, 8192)
    assert shape.weights_bytes == 96_576_768  # 92.1 MiB: the tensor table, not the file size
    assert kv_bytes_per_token(shape, "f16") == 23_040  # 2 x 30 x 3 x 64 x 2 B


def test_kv_bytes_for_quantized_caches_round_rows_to_blocks() -> None:
    shape = read_shape(embedded_file("smollm2-135m-instruct"))
    ggml = load_registry().backends["llamacpp"].obj.kv_cache_dtypes  # the plugin's prices
    # A K row is 3 heads x 64 = 192 values = 6 blocks of 32: 6 x 34 B in q8_0, 6 x 18 B in q4_0.
    assert kv_bytes_per_token(shape, "q8_0", ggml) == 30 * 2 * 6 * 34
    assert kv_bytes_per_token(shape, "q4_0", ggml) == 30 * 2 * 6 * 18


def test_seven_b_from_config_json_alone(tmp_path: Path) -> None:
    shape = read_shape(hf_folder(tmp_path, LLAMA_7B))
    assert kv_bytes_per_token(shape, "f16") == 512 * 1024  # 2 x 4096 x 2 B x 32 layers
    assert 6.7e9 * 2 < shape.weights_bytes < 6.8e9 * 2
    assert "estimated from config.json" in shape.weights_source


def test_grouped_query_attention_and_safetensors_headers(tmp_path: Path) -> None:
    config = {**LLAMA_7B, "num_key_value_heads": 8}
    folder = hf_folder(tmp_path, config)
    header = json.dumps({"a": {"dtype": "F16", "shape": [10, 10], "data_offsets": [0, 200]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [200, 220]},
                         "__metadata__": {"format": "pt"}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header +
                                               bytes(220))
    shape = read_shape(folder)
    assert kv_bytes_per_token(shape, "f16") == 128 * 1024  # 8 of 32 heads
    assert shape.weights_bytes == 220 and "safetensors headers (1 files)" in shape.weights_source


def test_unreadable_models_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_shape(tmp_path / "x.gguf")
    with pytest.raises(ModelFileError, match="no config.json"):
        read_shape(tmp_path)


def test_budget_sources(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 8388608 kB\n")  # 8 GiB
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("max\n")
    b = budget_mod.detect(None, cg, meminfo)
    assert b.source.startswith("MemAvailable") and b.bytes == 8 * 2**30 - int(0.8 * 2**30)
    (cg / "memory.max").write_text(str(2 * 2**30))
    b = budget_mod.detect(None, cg, meminfo)
    assert "cgroup" in b.source and b.bytes == 2 * 2**30 - 256 * 2**20
    assert budget_mod.detect(12345, cg, meminfo) == budget_mod.Budget(12345, "manifest [memory] budget")


def plan_of(models: list[dict], budget: str = "64GiB") -> planner.Plan:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict({"memory": {"budget": budget}, "models": models}),
                          registry, need_backends=False)
    return planner.make_plan(manifest, registry)


def test_the_32k_times_8_disaster_is_refused_with_settings_that_fit(tmp_path: Path) -> None:
    plan = plan_of([{"name": "big", "path": str(hf_folder(tmp_path, LLAMA_7B)),
                     "backend": "llamacpp", "max_seq_len": 32768, "max_num_seqs": 8}])
    (r,) = plan.replicas
    assert r.kv_bytes_per_seq == 16 * 2**30 and r.kv_pool_bytes == 128 * 2**30
    assert not plan.fits
    text = "\n".join(plan.suggestions)
    # max_num_seqs 2, not 3: the saved KV (a quarter of the pool) is planned too
    assert "max_seq_len = " in text and "max_num_seqs = 2" in text and "q4_0" in text
    for suggestion in plan.suggestions:  # each suggestion really fits when applied
        key, value = suggestion.split(" (")[0].split(" = ")
        change = {key.split(".")[1]: json.loads(value)}
        fixed = plan_of([{"name": "big", "path": str(tmp_path), "backend": "llamacpp",
                          "max_seq_len": 32768, "max_num_seqs": 8, **change}])
        assert fixed.fits, suggestion


def test_kv_cache_tokens_decides_the_number_of_sequences(tmp_path: Path) -> None:
    plan = plan_of([{"name": "m", "path": "embedded:smollm2-135m-instruct",
                     "max_seq_len": 1024, "kv_cache_tokens": 5000}])
    (r,) = plan.replicas
    assert r.pool_tokens == 5000 and r.config.max_num_seqs == 4 and r.max_concurrent_seqs == 4
    with pytest.raises(mf.ManifestError) as info:
        plan_of([{"name": "m", "path": "embedded:smollm2-135m-instruct",
                  "kv_cache_tokens": 1000}])  # default max_seq_len 4096 does not fit 1000
    assert info.value.key == "models[0].kv_cache_tokens"


def test_the_default_runs_8_sequences_only_where_their_kv_is_small_and_fits(
        tmp_path: Path) -> None:
    """Neither max_num_seqs nor kv_cache_tokens: 8 sequences where their pool is at most
    2 GiB and the plan fits with them (the embedded model: 8 x 4096 x 22.5 KiB = 720 MiB);
    4 for a 7B model (8 x 4096 x 512 KiB would be 16 GiB), and 4 where the budget holds 4
    and not 8; what the manifest sets is kept."""
    embedded = {"name": "m", "path": "embedded:smollm2-135m-instruct"}
    (r,) = plan_of([embedded]).replicas
    assert r.config.max_num_seqs == 8 and r.kv_pool_bytes == 720 * 2**20
    (r,) = plan_of([{"name": "big", "path": str(hf_folder(tmp_path, LLAMA_7B)),
                     "backend": "llamacpp"}], budget="256GiB").replicas
    assert r.config.max_num_seqs == 4 and r.kv_pool_bytes == 8 * 2**30
    roomy, default = (plan_of([{**embedded, "max_num_seqs": n}]).total_bytes for n in (8, 4))
    between = (roomy + default) // 2  # a budget with room for 4 sequences, not for 8
    (r,) = plan_of([embedded], budget=str(between)).replicas
    assert r.config.max_num_seqs == 4
    (r,) = plan_of([{**embedded, "max_num_seqs": 2}]).replicas
    assert r.config.max_num_seqs == 2


def test_default_max_seq_len_is_the_smaller_of_4096_and_the_models(tmp_path: Path) -> None:
    plan = plan_of([{"name": "m", "path": "embedded:smollm2-135m-instruct"},
                    {"name": "short", "backend": "other",
                     "path": str(hf_folder(tmp_path, {**LLAMA_7B,
                                                      "max_position_embeddings": 2048}))}])
    assert [r.max_seq_len for r in plan.replicas] == [4096, 2048]
    # 8 x 4096 tokens of the embedded model's KV is 720 MiB; the 7B's 8 x 2048 is 8 GiB.
    assert [r.config.max_num_seqs for r in plan.replicas] == [8, 4]


def test_ray_asks_for_the_threads_the_backend_says_a_replica_uses() -> None:
    from laya_core.replica.ray_placement import Node, place

    model = {"name": "m", "path": "embedded:smollm2-135m-instruct", "backend": "llamacpp"}
    plan = plan_of([{**model, "options": {"n_threads": 3}}, {**model, "name": "n"}])
    assert [r.cpu_threads for r in plan.replicas] == [3, None]  # None: Ray's one CPU
    two, four = Node("a", "10.0.0.1", 2**40, 2.0), Node("b", "10.0.0.2", 2**40, 4.0)
    assert [node.node_id if node else None for _, node in place(plan, [two, four])] == \
        ["b", "a"]  # three threads fit only the node of four CPUs


def test_the_plan_prices_kv_with_the_backends_own_types() -> None:
    from laya_core.backend import Backend
    from laya_core.hookspecs import hookimpl

    class Exl(Backend):  # never loaded: the plan asks only its classmethods
        name = "exl"
        kv_cache_dtypes = {"fp16": (1, 2), "q8": (32, 34), "q6": (32, 26), "q4": (32, 18)}

    class Plugin:
        @hookimpl
        def register_backends(self, register):  # type: ignore[no-untyped-def]
            register("exl", Exl)

    registry = load_registry([Plugin()])
    shape = read_shape(embedded_file("smollm2-135m-instruct"))

    def plan(budget: str, dtype: str) -> planner.Plan:
        data = {"memory": {"budget": budget}, "models": [{
            "name": "m", "backend": "exl", "path": "embedded:smollm2-135m-instruct",
            "kv_cache_dtype": dtype, "max_seq_len": 8192, "max_num_seqs": 8}]}
        return planner.make_plan(mf.resolve(mf.from_dict(data), registry), registry)

    (r,) = plan("64GiB", "q6").replicas
    # A K row: 3 heads x 64 = 192 values = 6 blocks of 32, 26 bytes each; K and V, 30 layers.
    assert r.profile.kv_bytes_per_token == 30 * 2 * 6 * 26
    assert r.profile.kv_bytes_per_token == kv_bytes_per_token(shape, "q6", Exl.kv_cache_dtypes)
    # What does not fit at fp16 is offered the backend's own smaller types, least cut first.
    fp16 = plan("64GiB", "fp16").replicas[0]
    tight = fp16.total_bytes - fp16.kv_pool_bytes + fp16.kv_pool_bytes * 3 // 4
    suggestions = plan(str(tight), "fp16").suggestions
    assert 'models[0].kv_cache_dtype = "q8" (a smaller KV element type)' in suggestions


def test_on_demand_models_fit_one_at_a_time_beside_the_pinned_ones(tmp_path: Path) -> None:
    def entry(name: str, seq_len: int, load: str = "on_demand") -> dict[str, object]:
        return {"name": name, "path": "embedded:smollm2-135m-instruct", "backend": "llamacpp",
                "max_seq_len": seq_len, "max_num_seqs": 4, "load": load}

    models = [entry("pinned", 1024, "always"), entry("small", 1024), entry("large", 4096)]
    everything = plan_of(models)
    one = {m: everything.model_bytes(m) for m in ("pinned", "small", "large")}
    assert everything.largest_on_demand == "large"
    assert everything.total_bytes < everything.runtime_bytes + sum(one.values())  # not all
    budget = everything.total_bytes  # room for the pinned one and the largest
    assert budget <= everything.runtime_bytes + one["pinned"] + one["large"]
    plan = plan_of(models, budget=budget)  # type: ignore[arg-type]
    assert plan.fits and plan.total_bytes <= budget
    assert {r.model for r in plan.peak} == {"pinned", "large"}
    tight = plan_of(models, budget=budget - 1)  # type: ignore[arg-type]
    assert not tight.fits
    assert tight.suggestions and all(s.startswith("models[2].") for s in tight.suggestions)
    text = report.format_plan(tight)
    assert "largest on demand" in text and "Each model named needs one of its lines" in text
