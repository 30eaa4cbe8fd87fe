"""PEFT LoRA folders read and checked from their headers (laya_core/models/lora.py), and the
manifest's ``lora`` table: a bad folder is refused naming the key and the tensor or field,
before anything loads. The folders are written here with safetensors' own writer, in the
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
    assert "does not apply LoRA adapters" in found["models[0].lora"]
    found = problems_of({"models": [{**model, "lora": {"m": "good"}},
                                    {**model, "name": "n", "lora": {"good": "good"}},
                                    {**model, "name": "o", "lora": {"good": "good"}}]},
                        tmp_path)
    assert "is the name of models[0]" in found["models[0].lora.m"]
    assert "already an adapter of 'n'" in found["models[2].lora.good"]
    manifest = mf.resolve(mf.from_dict({"models": [{**model, "lora": {"good": "good"}}]},
                                       base_dir=tmp_path), load_registry())
    assert manifest.models[0].lora == {"good": str(tmp_path / "good")}
