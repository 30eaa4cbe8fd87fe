"""GPTQ and AWQ folders made from the embedded model by auto-round, served by the torch
backend as stored and checked against auto-round's own loader (transformers with
``AutoRoundConfig``), which reads GPTQ; AWQ is checked against the GPTQ folder the same run
wrote, the same integers packed the other way.

The checkpoints are made once (about a minute of CPU each: the Hugging Face export, then
``auto-round --iters 0``, round-to-nearest with no calibration data) and kept under
``$LAYA_TEST_CACHE`` (default ``~/.cache/laya-tests``), keyed by auto-round's version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from laya_backend_torch.checkpoint import open_checkpoint
from laya_backend_torch.packed import GroupQuant
from laya_backend_torch.quant import Int4Linear
from torch_fixtures import *  # noqa: F403 - the fixtures (torch_fixtures.py)
from torch_fixtures import PROMPTS, pack_words

from laya_core.builtin.model_paths import embedded_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Layer 0's and the last layer's projections: every kind of matrix, both ends of the model.
CHECKED_LAYERS = ("model.layers.0.", "model.layers.29.")


def _auto_round(hf: Path, out: Path, *flags: str) -> Path:
    """auto-round's GPTQ and AWQ folders of ``hf``, 4 bits in groups of 32 (SmolLM2's
    hidden size, 576, is no multiple of 128)."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "auto_round", "--model", str(hf), "--bits", "4",
                    "--group_size", "32", "--iters", "0", "--disable_opt_rtn", *flags,
                    "--format", "auto_gptq,auto_awq", "--output_dir", str(tmp)],
                   check=True, capture_output=True, timeout=900,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    (made,) = tmp.iterdir()  # auto-round names it after the model and the scheme
    made.rename(out)
    tmp.rmdir()
    return out


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    """``{"gptq", "awq", "gptq-asym", "awq-asym", "gptq-act-order"}`` -> folder, made
    once and kept."""
    import auto_round
    from laya_backend_torch.export import main as export_main

    cache = Path(os.environ.get("LAYA_TEST_CACHE", Path.home() / ".cache" / "laya-tests"))
    root = cache / f"smollm2-auto-round-{auto_round.__version__}"
    hf = root / "hf"
    if not (hf / "model.safetensors").exists():
        shutil.rmtree(hf, ignore_errors=True)
        assert export_main(["--dtype", "bfloat16", embedded_file("smollm2-135m-instruct"),
                            str(hf)]) == 0
    out = {"gptq-act-order": root / "gptq-act-order"}
    if not out["gptq-act-order"].exists():
        _act_order_gptq(hf, out["gptq-act-order"])
    for name, flags in (("sym", ()), ("asym", ("--asym",))):
        folder = root / name
        if not folder.exists():
            _auto_round(hf, folder, *flags)
        suffix = "" if name == "sym" else "-asym"
        out["gptq" + suffix], out["awq" + suffix] = folder / "auto-gptq", folder / "auto-awq"
    return out


def act_order_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's act-order layout of a dense [out, in] matrix, rounded to the nearest: the
    inputs by decreasing column norm, 32 at a time into a group (every group's inputs
    scattered over the matrix), 16 symmetric levels (zero 8). Returns q [in, out], scales
    [groups, out] (float16) and g_idx [in]. The tools pick the order from activations
    (GPTQ's Hessian); any order makes the same format."""
    w = w.float()
    order = torch.argsort(w.norm(dim=0), descending=True)
    g_idx = torch.empty(w.shape[1], dtype=torch.long)
    g_idx[order] = torch.arange(w.shape[1]) // 32
    groups = w.T[order].reshape(-1, 32, w.shape[0])  # [groups, 32, out]
    scales = (groups.abs().amax(dim=1) / 7.5).clamp(min=1e-8).to(torch.float16)
    q = torch.clamp(torch.round(w.T / scales.float()[g_idx]) + 8, 0, 15)
    return q, scales, g_idx


def _act_order_gptq(hf: Path, out: Path) -> Path:
    """A GPTQ folder with act-order (``desc_act``) of ``hf`` (:func:`act_order_rtn`, zeros
    stored less one: v1), written here with the formats' own packing (``pack_words``):
    neither auto-round nor its loader makes or reads act-order."""
    import json

    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(hf, tmp)
    tensors = load_file(hf / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        q, scales, g_idx = act_order_rtn(tensors.pop(name))
        base = name.removesuffix(".weight")
        tensors |= {f"{base}.qweight": pack_words(q, 4, 0),
                    f"{base}.qzeros": pack_words(torch.full_like(scales, 7, dtype=torch.int64),
                                                 4, 1),
                    f"{base}.scales": scales, f"{base}.g_idx": g_idx.to(torch.int32)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "sym": True, "desc_act": True, "checkpoint_format": "gptq"}
    (tmp / "config.json").write_text(json.dumps(cfg))
    tmp.rename(out)
    return out


def packed_layers(path: Path) -> dict[str, GroupQuant]:
    return {name: t for name, t in open_checkpoint(str(path)).tensors()
            if isinstance(t, GroupQuant) and name.startswith(CHECKED_LAYERS)}


def auto_round_model(path: Path) -> Any:
    """transformers with auto-round's torch kernels, float32, from a GPTQ folder."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoRoundConfig

    with warnings.catch_warnings():  # "the model's own quantization_config will be used"
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(
            path, quantization_config=AutoRoundConfig(backend="torch"),
            dtype=torch.float32, device_map="cpu").eval()


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> Any:
    """The reference of the symmetric GPTQ folder auto-round wrote."""
    return auto_round_model(checkpoints["gptq"])


def reference_matrix(reference: Any, name: str, in_features: int) -> torch.Tensor:
    """The reference's dequantized matrix [out, in]: its layer applied to the identity."""
    with torch.inference_mode():
        return reference.get_submodule(name.removesuffix(".weight"))(
            torch.eye(in_features)).T.float()


def test_gptq_and_awq_layers_equal_auto_rounds_own_loader(checkpoints: dict[str, Path],
                                                          reference: Any) -> None:
    for kind in ("gptq", "awq"):
        layers = packed_layers(checkpoints[kind])
        assert len(layers) == 14
        for name, gq in layers.items():
            want = reference_matrix(reference, name, gq.shape[1])
            assert torch.equal(gq.dequantize(), want), (kind, name)
            # Through the kernel only each group's scale and zero offset are rounded, to
            # bfloat16: one step of 2^-8 at most.
            kernel = Int4Linear.of(gq, None, torch.bfloat16, torch.device("cpu"))
            assert type(kernel) is Int4Linear
            step = 2**-8 * want.abs().max().item()
            assert (kernel.dequantized() - want).abs().max().item() <= step, (kind, name)


def test_act_order_layers_are_the_matrices_written(checkpoints: dict[str, Path]) -> None:
    """auto-round's loader refuses a g_idx other than i // group_size, and gptqmodel (the
    act-order reader) pins numpy and torchao versions that the rest of the suite does not
    take; so the check is against the matrices the folder was written from."""
    from safetensors.torch import load_file

    dense = load_file(checkpoints["gptq-act-order"].parent / "hf" / "model.safetensors")
    layers = packed_layers(checkpoints["gptq-act-order"])
    assert len(layers) == 14
    for name, gq in layers.items():
        assert gq.grouped_inputs() is not None  # scattered groups: the inputs reordered
        q, scales, g_idx = act_order_rtn(dense[name])
        want = (scales.float()[g_idx] * (q - 8)).T
        assert torch.equal(gq.dequantize(), want), name
        kernel = Int4Linear.of(gq, None, torch.bfloat16, torch.device("cpu"))
        assert type(kernel) is Int4Linear and kernel.inputs is not None
        step = 2**-8 * want.abs().max().item()
        assert (kernel.dequantized() - want).abs().max().item() <= step, name
        x = torch.randn(3, gq.shape[1])
        got = kernel(x.to(torch.bfloat16)).float()
        assert torch.allclose(got, x @ want.T, atol=0.05 * (x @ want.T).abs().max().item())


def test_asymmetric_awq_equals_its_gptq_twin(checkpoints: dict[str, Path]) -> None:
    """auto-round's loader reads no asymmetric folder here, so the two formats of one run
    check each other: the same integers and zero points, packed differently."""
    gptq, awq = packed_layers(checkpoints["gptq-asym"]), packed_layers(checkpoints["awq-asym"])
    assert gptq.keys() == awq.keys()
    for name in gptq:
        assert torch.unique(gptq[name].zeros).numel() > 1  # real zero points
        assert torch.equal(gptq[name].dequantize(), awq[name].dequantize()), name


def test_logits_agree_with_transformers_and_auto_round(checkpoints: dict[str, Path],
                                                       reference: Any) -> None:
    """Laya's int4 kernel (bfloat16 activations) against the reference's float32 matmuls."""
    from laya_backend_torch.backend import TorchBackend
    from laya_backend_torch.model import build_batch

    from laya_core.backend import ModelConfig

    backend = TorchBackend(ModelConfig(name="q", backend="torch", path=str(checkpoints["gptq"]),
                                       options={"n_threads": 1}))
    backend.load_weights()
    backend.allocate_kv(num_tokens=64 * 16, max_num_seqs=1)
    model = backend._model
    assert backend.describe()["quantize"] == "int4"
    for prompt in PROMPTS:
        ids = backend.tokenizer().encode(prompt, add_special=True)
        table = list(range(-(-len(ids) // 16)))
        with torch.inference_mode():
            ours = model.forward(build_batch([(ids, 0, table)], list(range(len(ids))), 16))
            theirs = reference(torch.tensor([ids])).logits[0].float()
        # The tolerance: bfloat16 activations and the output head in int8 (the model's
        # rule for quantized layers) against float32 throughout. Measured (Intel Xeon):
        # at most 2.0 over logits up to 39, the arg-max the same at every position.
        diff = (ours - theirs).abs().max().item()
        assert diff < 3.0, (prompt, diff)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), prompt


@pytest.fixture
def served_awq(checkpoints: dict[str, Path], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    from conftest import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "laya_core.cli.main", "serve",
                                 str(checkpoints["awq-asym"]), "--port", str(port),
                                 "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log.read_text()
            import time

            time.sleep(0.2)
        yield url, log
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()


def test_laya_serve_runs_an_awq_folder_with_no_manifest(served_awq: tuple[str, Path]) -> None:
    url, log = served_awq
    (replica,) = httpx.get(url + "/ready").json()["replicas"]
    checkpoint = replica["runtime"]["checkpoint"]
    assert "AWQ 4-bit, group size 32, asymmetric" in checkpoint
    assert replica["runtime"]["quantize"] == "int4"
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    assert "AWQ 4-bit" in log.read_text()  # the start-up log says the format
