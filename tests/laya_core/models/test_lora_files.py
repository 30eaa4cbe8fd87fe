"""PEFT LoRA folders and llama.cpp's GGUF adapters read and checked from their headers
(laya_core/models/lora.py), and the manifest's ``lora`` table: a bad adapter is refused
naming the key and the tensor or field, before anything loads. The folders are written here with safetensors' own writer, in the
embedded model's shapes (SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads of 64)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from laya_core.config import manifest as mf
from laya_core.models.files import read_shape
from laya_core.models.lora import AdapterError, read_adapter
from laya_core.plugins import load_registry

EMBEDDED = "embedded:smollm2-135m-instruct"
OUTS = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576, "gate_proj": 1536,
        "up_proj": 1536, "down_proj": 576}
INS = {"q_proj": 576, "k_proj": 576, "v_proj": 576, "o_proj": 576, "gate_proj": 576,
       "up_proj": 576, "down_proj": 1536}


def write_adapter(folder: Path, r: int = 4, layers: range = range(30),
                  modules: tuple[str, ...] = ("q_proj", "v_proj"), ins: dict[str, int] = INS,
                  **config: Any) -> Path:
    folder.mkdir(parents=True)
    tensors = {}
    for i in layers:
        for m in modules:
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            p = f"base_model.model.model.layers.{i}.{block}.{m}"
            tensors[f"{p}.lora_A.weight"] = np.zeros((r, ins[m]), np.float32)
            tensors[f"{p}.lora_B.weight"] = np.zeros((OUTS[m], r), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
           "target_modules": list(modules), "bias": "none", **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def shape() -> Any:
    return read_shape(load_registry().resolve_model_path(EMBEDDED))


def refusal(folder: Path, shape: Any) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter(folder, shape)
    return str(e.value)


def test_a_good_folder_reads_with_its_scale_and_size(tmp_path: Path, shape: Any) -> None:
    a = read_adapter(write_adapter(tmp_path / "a", r=4, use_rslora=False), shape)
    assert (a.rank, a.scale, a.modules) == (4, 2.0, frozenset({"q_proj", "v_proj"}))
    assert a.num_elements == 30 * (4 * 576 + 576 * 4 + 4 * 576 + 192 * 4)
    rs = read_adapter(write_adapter(tmp_path / "b", r=4, use_rslora=True), shape)
    assert rs.scale == 8 / 2  # lora_alpha / sqrt(r)


@pytest.mark.parametrize(("config", "field"), [
    ({"r": 0}, "r"), ({"r": "8"}, "r"), ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type"), ({"lora_alpha": "x"}, "lora_alpha"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern")])
def test_what_is_not_plain_lora_is_refused_naming_the_field(
        tmp_path: Path, shape: Any, config: dict[str, Any], field: str) -> None:
    folder = write_adapter(tmp_path / "a", r=4)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    assert f"adapter_config.json: {field} " in refusal(folder, shape)


def test_an_adapter_of_another_model_is_refused_naming_the_tensor(tmp_path: Path,
                                                                   shape: Any) -> None:
    wide = write_adapter(tmp_path / "wide", ins={**INS, "q_proj": 768})
    assert "layers.0.q_proj: in features 768, the base model's are 576" in refusal(wide, shape)
    deep = write_adapter(tmp_path / "deep", layers=range(32))
    assert "layers.30.q_proj: the base model has 30 layers" in refusal(deep, shape)
    mlp = write_adapter(tmp_path / "mlp", modules=("gate_proj", "down_proj"),
                        ins={**INS, "down_proj": 1024})
    assert "intermediate size ([1024, 1536])" in refusal(mlp, shape)


def test_a_truncated_or_mangled_file_is_refused(tmp_path: Path, shape: Any) -> None:
    folder = write_adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    assert "is truncated: its tensors need" in refusal(folder, shape)
    weights.write_bytes(data[:5])
    assert "is truncated" in refusal(folder, shape)
    weights.write_bytes(b"\xff" * 64)
    assert "header claims" in refusal(folder, shape)
    (folder / "adapter_config.json").write_text("{")
    assert "adapter_config.json is not JSON" in refusal(folder, shape)
    assert "no such folder" in refusal(tmp_path / "none", shape)


def test_a_stray_or_unpaired_tensor_is_refused(tmp_path: Path, shape: Any) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 576), np.float32)},
              str(folder / "adapter_model.safetensors"))
    assert "is no LoRA matrix of a decoder layer" in refusal(folder, shape)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               np.zeros((4, 576), np.float32)}, str(folder / "adapter_model.safetensors"))
    assert "has lora_A without its partner" in refusal(folder, shape)


def problems_of(data: dict[str, Any], base: Path) -> dict[str, str]:
    with pytest.raises(mf.ManifestError) as e:
        mf.resolve(mf.from_dict(data, base_dir=base), load_registry())
    return dict(e.value.problems)


def test_the_manifest_names_the_adapter_key(tmp_path: Path) -> None:
    write_adapter(tmp_path / "good")
    write_adapter(tmp_path / "wide", ins={**INS, "v_proj": 100})
    model = {"name": "m", "backend": "torch", "path": EMBEDDED,
             "lora": {"good": "good", "wide": "wide"}}
    found = problems_of({"models": [model]}, tmp_path)
    assert list(found) == ["models[0].lora.wide"], found
    assert "in features 100" in found["models[0].lora.wide"]
    found = problems_of({"models": [{**model, "backend": "llamacpp",
                                     "lora": {"good": "good"}}]}, tmp_path)
    assert "convert_lora_to_gguf.py" in found["models[0].lora.good"]  # llama.cpp's: GGUF
    found = problems_of({"models": [{**model, "lora": {"m": "good"}},
                                    {**model, "name": "n", "lora": {"good": "good"}},
                                    {**model, "name": "o", "lora": {"good": "good"}}]},
                        tmp_path)
    assert "is the name of models[0]" in found["models[0].lora.m"]
    assert "already an adapter of 'n'" in found["models[2].lora.good"]
    manifest = mf.resolve(mf.from_dict({"models": [{**model, "lora": {"good": "good"}}]},
                                       base_dir=tmp_path), load_registry())
    assert manifest.models[0].lora == {"good": str(tmp_path / "good")}


def gguf_adapter(path: Path, shape: Any, **kw: Any) -> Path:
    """An adapter of random q and v matrices as llama.cpp's GGUF (the conformance kit's
    writer); ``kw`` as ``random_adapter``'s."""
    from laya_core.testing.adapters import random_adapter

    return random_adapter(path, shape, seed=0, fmt="gguf", **kw)


def test_a_gguf_adapter_reads_with_llama_cpps_scale_and_size(tmp_path: Path,
                                                             shape: Any) -> None:
    from laya_core.models.lora import read_gguf_adapter

    a = read_gguf_adapter(gguf_adapter(tmp_path / "a", shape, rank=4, alpha=8.0), shape)
    assert (a.rank, a.alpha, a.scale) == (4, 8.0, 2.0)
    assert a.modules == frozenset({"q_proj", "v_proj"})
    assert a.nbytes == 4 * 30 * (4 * 576 + 576 * 4 + 4 * 576 + 192 * 4)
    # llama.cpp's reading of an alpha of 0: no alpha, the matrices as they are.
    assert read_gguf_adapter(gguf_adapter(tmp_path / "b", shape, alpha=0.0)).scale == 1.0


def test_a_bad_gguf_adapter_is_refused_saying_why(tmp_path: Path, shape: Any) -> None:
    import gguf

    from laya_core.models.lora import read_gguf_adapter

    def refused(path: Path) -> str:
        with pytest.raises(AdapterError) as e:
            read_gguf_adapter(path, shape)
        return str(e.value)

    good = gguf_adapter(tmp_path / "good", shape)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])
    assert "truncated" in refused(cut)
    peft = write_adapter(tmp_path / "peft")
    assert "convert_lora_to_gguf.py" in refused(peft)
    model = Path(load_registry().resolve_model_path(EMBEDDED))
    assert "general.type is 'model'" in refused(model)
    assert "no such file" in refused(tmp_path / "nothing.gguf")

    def written(name: str, tensors: dict[str, np.ndarray], **meta: str) -> Path:
        w = gguf.GGUFWriter(tmp_path / name, "llama")
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", meta.get("type", "lora"))
        for key, value in meta.items():
            if key != "type":
                w.add_string(key, value)
        for tensor, data in tensors.items():
            w.add_tensor(tensor, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    a, b = np.zeros((4, 576), np.float32), np.zeros((576, 4), np.float32)
    assert "adapter.type is 'control_vector'" in refused(
        written("cv.gguf", {"blk.0.attn_q.weight.lora_a": a}, type="control_vector"))
    assert "layers.0.q_proj has lora_A without its partner" in refused(
        written("half.gguf", {"blk.0.attn_q.weight.lora_a": a}))
    assert "'token_embd.weight.lora_a' is no LoRA matrix" in refused(
        written("embd.gguf", {"token_embd.weight.lora_a": a}))
    assert "in features 512, the base model's are 576" in refused(written("other.gguf", {
        "blk.0.attn_q.weight.lora_a": np.zeros((4, 512), np.float32),
        "blk.0.attn_q.weight.lora_b": b}))
    assert "activated LoRA" in refused(written("alora.gguf", {
        "blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
        **{"adapter.alora.invocation_tokens": "x"}))
