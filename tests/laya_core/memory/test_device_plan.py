"""Plans on GPUs, made here without one: ``laya plan --ram --gpus`` for another machine.

The model files are real headers of 7B-shaped models (a Hugging Face folder, a GGUF file)
whose data is a hole in a sparse file: the plan reads headers only, so it prices them as it
would the real ones.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from laya_core.memory import devices
from laya_core.memory.budget import parse_size

GIB = 2**30
# Llama-2-7B's shape (no grouped-query attention: 512 KiB of f16 KV a token).
LLAMA_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A safetensors file whose header lists ``shapes`` (name -> (shape, dtype)) and whose
    data is a hole of the right length."""
    size = {"F16": 2, "BF16": 2, "I32": 4, "F32": 4}
    header: dict[str, Any] = {}
    at = 0
    for name, (shape, dtype) in shapes.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + at)


def _hf_7b(folder: Path, max_positions: int, awq: bool = False) -> Path:
    """A Llama-2-7B-shaped folder: float16, or AWQ 4-bit (group 128, GEMM)."""
    folder.mkdir()
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                           **LLAMA_7B, "max_position_embeddings": max_positions,
                           "rms_norm_eps": 1e-5, "torch_dtype": "float16",
                           "tie_word_embeddings": False}
    h, inter, vocab = LLAMA_7B["hidden_size"], LLAMA_7B["intermediate_size"], 32000
    if awq:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                      "version": "gemm", "zero_point": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((vocab, h), "F16"), "model.norm.weight": ((h,), "F16"),
        "lm_head.weight": ((vocab, h), "F16")}
    for i in range(LLAMA_7B["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = ((h,), "F16")
        shapes[p + "post_attention_layernorm.weight"] = ((h,), "F16")
        for name, out, n_in in (("self_attn.q_proj", h, h), ("self_attn.k_proj", h, h),
                                ("self_attn.v_proj", h, h), ("self_attn.o_proj", h, h),
                                ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h),
                                ("mlp.down_proj", h, inter)):
            if awq:  # [in, out / 8] int32 words, a zero word and a scale per 128 inputs
                shapes[p + name + ".qweight"] = ((n_in, out // 8), "I32")
                shapes[p + name + ".qzeros"] = ((n_in // 128, out // 8), "I32")
                shapes[p + name + ".scales"] = ((n_in // 128, out), "F16")
            else:
                shapes[p + name + ".weight"] = ((out, n_in), "F16")
    _sparse_safetensors(folder / "model.safetensors", shapes)
    return folder


def _gguf_7b(path: Path, kind: gguf.GGMLQuantizationType) -> Path:
    """A Llama-2-7B-shaped GGUF file: its metadata, vocabulary and tensor table, the tensor
    data a hole."""
    h, inter, vocab = LLAMA_7B["hidden_size"], LLAMA_7B["intermediate_size"], 32000
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(32)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(32)
    w.add_head_count_kv(32)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    f32 = gguf.GGMLQuantizationType.F32

    def tensor(name: str, shape: tuple[int, ...], dtype: gguf.GGMLQuantizationType) -> None:
        block, size = gguf.GGML_QUANT_SIZES[dtype]
        n = 1
        for d in shape:
            n *= d
        w.add_tensor_info(name, shape, np.dtype(np.float32), n // block * size, raw_dtype=dtype)

    tensor("token_embd.weight", (vocab, h), kind)
    for i in range(32):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{name}.weight", (h, h), kind)
        tensor(f"blk.{i}.ffn_gate.weight", (inter, h), kind)
        tensor(f"blk.{i}.ffn_up.weight", (inter, h), kind)
        tensor(f"blk.{i}.ffn_down.weight", (h, inter), kind)
        tensor(f"blk.{i}.attn_norm.weight", (h,), f32)
        tensor(f"blk.{i}.ffn_norm.weight", (h,), f32)
    tensor("output_norm.weight", (h,), f32)
    tensor("output.weight", (vocab, h), kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    data = sum(t.nbytes + -t.nbytes % 32 for t in w.tensors[0].values())  # each aligned
    w.close()
    with path.open("r+b") as f:
        f.seek(0, 2)
        f.truncate(f.tell() + -f.tell() % 32 + data)
    return path


def _plan(manifest: Path, *flags: str) -> tuple[int, dict[str, Any], str]:
    """``laya plan --json`` (its exit status and plan) and the plan as printed."""
    run = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", "--json",
                          *flags, str(manifest)], capture_output=True, text=True, timeout=120)
    text = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", *flags,
                           str(manifest)], capture_output=True, text=True, timeout=120)
    assert run.returncode == text.returncode, text.stderr
    return run.returncode, json.loads(run.stdout), text.stdout


WORKSTATION = ("--ram", "64GiB", "--gpus", "24GiB")  # the founding story's machine


@pytest.mark.slow
def test_the_founding_story_on_paper(tmp_path: Path) -> None:
    """A 7B float16 model with a 32k context and 8 sequences on an RTX 3090 (24 GB) beside
    64 GB of RAM is refused, with both devices' numbers; what its author ended with (AWQ
    4-bit, 4k context, 1 sequence) fits. On the torch backend's CUDA path the AWQ layers are
    served dense (no int4 kernel there), and priced so."""
    big = _hf_7b(tmp_path / "llama-7b-f16", 32768)
    awq = _hf_7b(tmp_path / "llama-7b-awq", 32768, awq=True)
    refused = tmp_path / "refused.toml"
    refused.write_text(f'[[models]]\nname = "seed"\nbackend = "torch"\npath = "{big}"\n'
                       'max_seq_len = 32768\nmax_num_seqs = 8\n'
                       '[models.options]\ndevice = "cuda"\ndtype = "float16"\n')
    rc, plan, text = _plan(refused, *WORKSTATION)
    assert rc == 1 and not plan["fits"]
    (replica,) = plan["replicas"]
    kv = 8 * 32768 * 512 * 2**10  # 8 sequences x 32k tokens x 512 KiB
    assert replica["kv_pool_bytes"] == kv
    gpu = plan["gpus"]["cuda:0"]
    assert gpu["total_bytes"] > kv + 12.5 * GIB  # the pool, and the weights beside it
    assert gpu["budget_bytes"] == parse_size("24GiB") - int(24 * GIB * 0.05)
    assert plan["budget_bytes"] == parse_size("64GiB") - int(64 * GIB * 0.10)
    # Both devices' numbers, and settings that fit.
    assert "cuda:0" in text and "OVER" in text and "over cuda:0's" in text
    assert "--ram 64 GiB" in text and "--gpus: 24 GiB" in text
    assert any("max_seq_len" in s or "max_num_seqs" in s for s in plan["suggestions"])

    ended = tmp_path / "ended.toml"
    ended.write_text(f'[[models]]\nname = "seed"\nbackend = "torch"\npath = "{awq}"\n'
                     'max_seq_len = 4096\nmax_num_seqs = 1\n'
                     '[models.options]\ndevice = "cuda"\n')
    rc, plan, text = _plan(ended, *WORKSTATION)
    assert rc == 0 and plan["fits"], text
    (replica,) = plan["replicas"]
    assert replica["kv_pool_bytes"] == 4096 * 512 * 2**10
    assert plan["gpus"]["cuda:0"]["total_bytes"] < plan["gpus"]["cuda:0"]["budget_bytes"]
    assert plan["total_bytes"] < 4 * GIB  # host RAM: libraries and the tokenizer


@pytest.mark.slow
def test_llamacpp_auto_offloads_what_the_gpu_holds(tmp_path: Path) -> None:
    """``n_gpu_layers = "auto"`` (the default) puts as many layers on the GPU as its budget
    holds, priced from the GGUF's tensor table, and their KV with them; the rest stays in
    host RAM. A smaller GPU takes fewer layers; an explicit number over the GPU is refused
    with a count that fits."""
    path = _gguf_7b(tmp_path / "llama-7b-f16.gguf", gguf.GGMLQuantizationType.F16)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[[models]]\nname = "m"\npath = "{path}"\nmax_seq_len = 4096\n'
                        'max_num_seqs = 1\n')
    layers = {}
    for gpu in ("24GiB", "12GiB", "none"):
        rc, plan, _ = _plan(manifest, "--ram", "64GiB", "--gpus", gpu)
        assert rc == 0 and plan["fits"]
        (replica,) = plan["replicas"]
        layers[gpu] = replica["gpu_bytes"].get("cuda:0", 0)
        if gpu != "none":
            assert plan["gpus"]["cuda:0"]["total_bytes"] <= plan["gpus"]["cuda:0"]["budget_bytes"]
    assert layers["24GiB"] > layers["12GiB"] > layers["none"] == 0
    # All 32 layers and the head fit 24 GiB: the host keeps the token embedding and its
    # own buffers; the GPU the rest of the weights, the KV, a context and a compute buffer.
    rc, plan, text = _plan(manifest, "--ram", "64GiB", "--gpus", "24GiB")
    (replica,) = plan["replicas"]
    assert "[cuda:0] the driver" in text and "GPU compute buffer" in text
    assert replica["gpu_bytes"]["cuda:0"] > replica["weights_bytes"] - 32000 * 4096 * 2 \
        + replica["kv_pool_bytes"]
    # Asked for every layer on a 6 GiB GPU: refused, with a count that fits.
    manifest.write_text(manifest.read_text() + '[models.options]\nn_gpu_layers = 33\n')
    rc, plan, text = _plan(manifest, "--ram", "64GiB", "--gpus", "6GiB")
    assert rc == 1 and "over cuda:0's" in text
    (fewer,) = [s for s in plan["suggestions"] if "n_gpu_layers" in s]
    n = int(fewer.split("= ")[1].split()[0])
    assert 0 < n < 33
    manifest.write_text(manifest.read_text().replace("n_gpu_layers = 33", f"n_gpu_layers = {n}"))
    rc, plan, _ = _plan(manifest, "--ram", "64GiB", "--gpus", "6GiB")
    assert rc == 0 and plan["fits"]


@pytest.mark.slow
def test_two_gpus_split_the_layers_by_their_budgets(tmp_path: Path) -> None:
    path = _gguf_7b(tmp_path / "llama-7b-f16.gguf", gguf.GGMLQuantizationType.F16)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[[models]]\nname = "m"\npath = "{path}"\nmax_seq_len = 4096\n'
                        'max_num_seqs = 2\n')
    rc, plan, _ = _plan(manifest, "--gpus", "16GiB,8GiB")
    assert rc == 0 and plan["fits"]
    (replica,) = plan["replicas"]
    on = replica["gpu_bytes"]
    assert set(on) == {"cuda:0", "cuda:1"} and on["cuda:0"] > on["cuda:1"] > 0


@pytest.mark.slow
def test_asking_for_a_gpu_on_a_machine_without_one_is_a_check_error(tmp_path: Path) -> None:
    """On this machine (no NVIDIA driver) an offload or a CUDA device is refused by ``laya
    check`` with the key named, exit 2, no traceback; ``"auto"`` (the default) offloads
    nothing and passes."""
    if devices.detect().budgets:
        pytest.skip("for a machine without a GPU; on a GPU machine the same manifests pass")
    from tests.hostile_gguf import embedded

    cases = {
        'n_gpu_layers = 8': "options.n_gpu_layers",
        'n_gpu_layers = "auto"': None,
    }
    for option, key in cases.items():
        manifest = tmp_path / "m.toml"
        manifest.write_text(f'[[models]]\nname = "m"\npath = "{embedded()}"\n'
                            f'[models.options]\n{option}\n')
        run = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "check",
                              str(manifest)], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in run.stderr
        if key is None:
            assert run.returncode == 0, run.stderr
        else:
            assert run.returncode == 2 and key in run.stderr and "has none" in run.stderr


@pytest.mark.slow
def test_a_plan_for_other_gpus_runs_the_backends_device_checks(tmp_path: Path) -> None:
    """``laya plan --gpus`` refuses what the machine it describes could not run (a GPU it
    lacks, by llama.cpp's and torch's options), naming that machine, as ``laya check`` does
    for this one; options within its GPUs plan."""
    from tests.hostile_gguf import embedded

    def plan(llama: str, torch: str) -> subprocess.CompletedProcess[str]:
        manifest = tmp_path / "m.toml"
        manifest.write_text(
            f'[[models]]\nname = "a"\npath = "{embedded()}"\n[models.options]\n{llama}\n'
            f'[[models]]\nname = "b"\nbackend = "torch"\npath = "{embedded()}"\n'
            f'[models.options]\n{torch}\n')
        return subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", "--gpus",
                               "16GiB,8GiB", str(manifest)], capture_output=True, text=True,
                              timeout=120)

    run = plan("main_gpu = 3", 'device = "cuda:2"')
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert ("models[0].options.main_gpu: GPU 3, but the machine planned for (--gpus) has 2 "
            "GPU(s) (cuda:0, cuda:1)") in run.stderr
    assert ('models[1].options.device: "cuda:2": the machine planned for (--gpus) has no such '
            "CUDA GPU (it has cuda:0, cuda:1)") in run.stderr
    run = plan("main_gpu = 1", 'device = "cuda:1"')
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(("text", "sizes"), [
    ("24GiB", (24 * GIB,)), ("24GiB,12GiB", (24 * GIB, 12 * GIB)),
    ("2x80GiB", (80 * GIB, 80 * GIB)), ("none", ())])
def test_gpus_flag(text: str, sizes: tuple[int, ...]) -> None:
    assert devices.parse_gpus(text) == sizes


@pytest.mark.parametrize("text", ["24", "lots", "20x1GiB", "24GiB,,"])
def test_a_bad_gpus_flag_is_said(text: str) -> None:
    with pytest.raises(ValueError):
        devices.parse_gpus(text)


@pytest.mark.slow
def test_a_gpu_budget_for_a_gpu_the_machine_lacks_is_named(tmp_path: Path) -> None:
    from tests.hostile_gguf import embedded

    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[memory]\ngpu_budget = {{ "cuda:3" = "10GiB" }}\n'
                        f'[[models]]\nname = "m"\npath = "{embedded()}"\n')
    run = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", "--gpus",
                          "24GiB", str(manifest)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "memory.gpu_budget.cuda:3" in run.stderr and "cuda:0" in run.stderr


def test_cuda_visible_devices_renumbers_nvmls_gpus() -> None:
    """NVML lists every GPU; CUDA numbers only the visible ones, in the order given, up to
    the first that is not a GPU; names other than numbers are left to CUDA (None)."""
    free = [10, 20, 30]
    assert devices.visible(free, None) == [10, 20, 30]
    assert devices.visible(free, "2,0") == [30, 10]
    assert devices.visible(free, "1,7,0") == [20]
    assert devices.visible(free, "") == []
    assert devices.visible(free, "GPU-8e6f0b9c") is None
    assert devices.visible(free, "-1") == []


def test_a_machine_without_a_driver_has_no_gpus_and_imports_nothing() -> None:
    import sys

    if devices._driver_present():
        pytest.skip("for a machine without NVIDIA's driver; this one has it")
    before = set(sys.modules)
    assert devices.detect() == devices.NO_GPUS
    assert not {"torch", "pynvml"} & (set(sys.modules) - before)
