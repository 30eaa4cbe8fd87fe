"""GPTQ and AWQ projections unpacked as stored (laya_backend_torch/packed.py), and run by the
4-bit kernel without a second rounding (quant.Int4Linear.from_groups).

The packers here are written from the formats' descriptions (GPTQ: inputs along each word,
zeros less one in v1; AWQ: outputs along each word in the order 0, 2, 4, 6, 1, 3, 5, 7), apart
from the code under test; the checkpoints the tools write are checked in
test_quantized_checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from laya_backend_torch.checkpoint import CheckpointError, open_checkpoint
from laya_backend_torch.packed import GroupQuant, PackedFormat, packed_format
from laya_backend_torch.quant import Int4Linear, Int8Linear
from torch_fixtures import *  # noqa: F403 - the fixtures (torch_fixtures.py)
from torch_fixtures import pack_words

OUT, IN, GROUP = 128, 96, 32


def _random(bits: int, sym: bool, act_order: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    top = 2**bits
    q = torch.randint(0, top, (IN, OUT), generator=g)  # [in, out], as GPTQ lays it out
    zeros = torch.full((IN // GROUP, OUT), top // 2) if sym else \
        torch.randint(1, top - 1, (IN // GROUP, OUT), generator=g)
    scales = (torch.rand(IN // GROUP, OUT, generator=g) * 0.02 + 0.001).to(torch.float16)
    g_idx = torch.arange(IN) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(IN, generator=g)]
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def _expected(m: dict[str, torch.Tensor]) -> torch.Tensor:
    g = m["g_idx"]
    return (m["scales"].float()[g] * (m["q"] - m["zeros"][g]).float()).T  # [out, in]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_unpacks_to_the_matrix_it_packs(bits: int, sym: bool, v2: bool,
                                             act_order: bool) -> None:
    m = _random(bits, sym, act_order)
    stored_zeros = m["zeros"] if v2 else (m["zeros"] - 1)
    tensors = {"p.qweight": pack_words(m["q"], bits, 0),
               "p.qzeros": pack_words(stored_zeros, bits, 1),
               "p.scales": m["scales"], "p.g_idx": m["g_idx"].to(torch.int32)}
    fmt = PackedFormat("gptq", bits, GROUP, sym, act_order, zeros_as_stored=v2)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == fmt.tensor_shapes("p", OUT, IN)
    assert torch.equal(fmt.unpack(tensors, "p").dequantize(), _expected(m))


@pytest.mark.parametrize("sym", [True, False])
def test_awq_unpacks_its_interleaved_columns(sym: bool) -> None:
    m = _random(4, sym, act_order=False)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k holds column order[k]
    tensors = {"p.qweight": pack_words(m["q"], 4, 1, order),
               "p.qzeros": pack_words(m["zeros"], 4, 1, order), "p.scales": m["scales"]}
    fmt = PackedFormat("awq", 4, GROUP, sym)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == fmt.tensor_shapes("p", OUT, IN)
    assert torch.equal(fmt.unpack(tensors, "p").dequantize(), _expected(m))


@pytest.mark.parametrize("act_order", [False, True])
def test_the_int4_kernel_runs_them_as_stored(act_order: bool) -> None:
    m = _random(4, sym=False, act_order=act_order, seed=3)
    m["scales"] = m["scales"].to(torch.bfloat16).to(torch.float16)  # the kernel's scales
    gq = GroupQuant(m["q"].T.to(torch.uint8).contiguous(), m["scales"].float(),
                    m["zeros"].float(), m["g_idx"], GROUP, 4)
    linear = Int4Linear.of(gq, None, torch.bfloat16, torch.device("cpu"))
    assert type(linear) is Int4Linear and (linear.inputs is not None) == act_order
    dense = gq.dequantize()
    # The integers as stored: only each group's scale and zero offset, (8 - z) x scale, are
    # rounded to the kernel's bfloat16.
    g = m["g_idx"]
    scale = m["scales"].float()[g].T
    offset = ((8 - m["zeros"][g].float()) * m["scales"].float()[g]).to(torch.bfloat16).float().T
    assert torch.equal(linear.dequantized(), (m["q"].T.float() - 8) * scale + offset)
    x = torch.randn(5, IN).to(torch.bfloat16)
    want = x.float() @ dense.T
    got = linear(x).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_eight_bits_take_the_int8_path_and_stacked_inputs_must_agree() -> None:
    m = _random(8, sym=True, act_order=False)
    gq = GroupQuant(m["q"].T.to(torch.uint8).contiguous(), m["scales"].float(),
                    m["zeros"].float(), m["g_idx"], GROUP, 8)
    assert type(Int4Linear.of(gq, None, torch.bfloat16, torch.device("cpu"))) is Int8Linear
    shuffled = GroupQuant(gq.q, gq.scales, gq.zeros, gq.g_idx.flip(0), GROUP, 8)
    with pytest.raises(ValueError, match="group it differently"):
        GroupQuant.stacked([gq, shuffled])
    both = GroupQuant.stacked([gq, gq])
    assert torch.equal(both.dequantize(), torch.cat([gq.dequantize()] * 2))


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv", "group_size": 32}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits 3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     "'compressed-tensors'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
])
def test_formats_it_does_not_run_are_refused_with_what_was_found(config: dict, words: str
                                                                 ) -> None:
    with pytest.raises(ValueError) as e:
        packed_format(config, "config.json")
    assert words in str(e.value) and ("GPTQ (4 or 8 bits" in str(e.value)
                                      or "group_size" in str(e.value))


def test_a_folder_missing_or_misshaping_a_packed_tensor_names_it(tmp_path: Path,
                                                                  hf_export_dir: Path) -> None:
    """The exported embedded model, its layer 0 q_proj replaced by packed tensors."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gptq"
    folder.mkdir()
    cfg = json.loads((hf_export_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "sym": True, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(hf_export_dir / "model.safetensors")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.0\.self_attn"
                                              r"\.q_proj\.qweight"):
        open_checkpoint(str(folder))
    fmt = packed_format(cfg["quantization_config"], "")
    for i in range(cfg["num_hidden_layers"]):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{proj}"
            out, n_in = tensors.pop(name + ".weight").shape
            for t, shape in fmt.tensor_shapes(name, out, n_in).items():
                tensors[t] = torch.zeros(shape, dtype=torch.int32 if "scales" not in t
                                         else torch.float16)
    # Every g_idx zero: all inputs in one group, which no kernel layout holds; named at load.
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj: .*"
                                              r"group_size inputs"):
        list(open_checkpoint(str(folder)).tensors())
    tensors["model.layers.3.mlp.up_proj.scales"] = torch.zeros(5, 5, dtype=torch.float16)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.up_proj\.scales has "
                                              r"shape \[5, 5\]"):
        open_checkpoint(str(folder))

