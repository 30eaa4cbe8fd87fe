"""Reading checkpoints (GGUF and Hugging Face folders) and ``laya-export-hf``.

The embedded model is exported and its logits compared with two independent readers of the
same GGUF file: transformers' own GGUF loader (its own un-permutation of Q and K) and
llama.cpp. Tiny random models written here as GGUF files cover what the embedded file lacks:
F16, BF16, Q8_0 and Q4_0 matrices, Qwen2's biases, Llama 3's rope_freqs.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as GGMLType
from gguf.quants import dequantize, quantize
from laya_backend_torch import gguf_checkpoint as ck
from laya_backend_torch.checkpoint import (
    CheckpointError,
    LlamaConfig,
    llama3_rope_factors,
    open_checkpoint,
    read_config,
)
from laya_backend_torch.export import main as export_main

from laya_core.builtin.model_paths import embedded_file

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who mended "
    "his nets every morning.",
]
# Exported folder against transformers' GGUF loader, both float32 from the same dequantized
# values: the same model computed the same way. Measured: 0.0 (bit-identical).
TRANSFORMERS_BOUND = 1e-4
# Against llama.cpp, which quantizes activations to 8 bits for its Q4_1 matrix products.
# Measured: arg-max equal at 100% of 65 positions, Pearson correlation of each row >= 0.998.
# A wrong permutation gives 54% and 0.66 (none) or 12% and 0.14 (K's heads for Q).
LLAMA_CPP_ARGMAX, LLAMA_CPP_CORRELATION = 0.9, 0.99


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: two beside another busy process run far slower (notes/torch-cpu.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return embedded_file("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def export_dir(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model exported into a folder holding a file already (hence --force)."""
    out = tmp_path_factory.mktemp("export")
    (out / "notes.txt").write_text("kept")
    assert export_main([gguf_path, str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def exported(export_dir: Path) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama_cpp_logits(gguf_path: str) -> list[tuple[list[int], np.ndarray]]:
    """(token ids, llama.cpp's logits [tokens, vocab]) of each prompt; one thread, no flash."""
    from laya_backend_llamacpp.reference import reference_llama

    llm = reference_llama(gguf_path, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                          logits_all=True, flash_attn=False, verbose=False)
    out = []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        out.append((ids, np.array(llm.scores[: len(ids)], dtype=np.float64)))
    llm.close()
    return out


def logits(model: torch.nn.Module, ids: list[int], **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), **kwargs).logits[0]


def agreement(model: torch.nn.Module, reference: list[tuple[list[int], np.ndarray]]
              ) -> tuple[float, float]:
    """Share of positions whose arg-max is llama.cpp's, and the lowest row correlation."""
    same, corr = [], []
    for ids, ref in reference:
        mine = logits(model, ids).double().numpy()
        same += list(mine.argmax(1) == ref.argmax(1))
        corr += [float(np.corrcoef(mine[i], ref[i])[0, 1]) for i in range(len(ids))]
    return float(np.mean(same)), min(corr)


def test_export_matches_transformers_gguf_loader(
        gguf_path: str, exported: transformers.LlamaForCausalLM,
        llama_cpp_logits: list[tuple[list[int], np.ndarray]]) -> None:
    path = Path(gguf_path)
    direct = transformers.LlamaForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for ids, _ in llama_cpp_logits:
        diff = (logits(exported, ids) - logits(direct, ids)).abs().max().item()
        assert diff < TRANSFORMERS_BOUND, diff


def test_export_matches_llama_cpp(exported: transformers.LlamaForCausalLM,
                                  llama_cpp_logits: list[tuple[list[int], np.ndarray]]) -> None:
    same, corr = agreement(exported, llama_cpp_logits)
    assert same >= LLAMA_CPP_ARGMAX and corr >= LLAMA_CPP_CORRELATION, (same, corr)


@pytest.mark.parametrize("wrong", ["not un-permuted", "Q un-permuted by n_head_kv"])
def test_a_wrong_permutation_is_caught(
        wrong: str, gguf_path: str, exported: transformers.LlamaForCausalLM,
        llama_cpp_logits: list[tuple[list[int], np.ndarray]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both comparisons above fail for Q and K read wrongly, so their passing means something
    (a wrong permutation still answers " Paris." to the first prompt)."""
    right = ck._unpermute
    n_kv = exported.config.num_key_value_heads
    monkeypatch.setattr(ck, "_unpermute", (lambda w, n: w) if wrong == "not un-permuted"
                        else (lambda w, n: right(w, n_kv)))
    model = copy.deepcopy(exported)
    model.load_state_dict(dict(open_checkpoint(gguf_path).tensors()), strict=False)
    ids = llama_cpp_logits[1][0]
    assert (logits(model, ids) - logits(exported, ids)).abs().max().item() > 1.0
    same, corr = agreement(model, llama_cpp_logits)
    assert same < LLAMA_CPP_ARGMAX and corr < LLAMA_CPP_CORRELATION, (same, corr)


def test_both_forms_read_the_same(gguf_path: str, export_dir: Path) -> None:
    a, b = open_checkpoint(gguf_path), open_checkpoint(str(export_dir))
    assert a.config == b.config == read_config(gguf_path) == read_config(str(export_dir))
    assert a.description == "GGUF: 272 tensors, Q4_1 (token_embd Q8_0, norms F32)"
    assert b.description == "safetensors: 272 tensors in 1 file, F32"
    assert a.shapes == b.shapes and a.rope_freqs is None
    for (name_a, x), (name_b, y), (name, shape) in zip(a.tensors(), b.tensors(),
                                                       a.shapes.items(), strict=True):
        assert name_a == name_b == name and tuple(x.shape) == shape
        assert x.dtype == torch.float32 and torch.equal(x, y), name  # float32 kept exactly


def test_config_of_the_embedded_model(export_dir: Path) -> None:
    config = read_config(str(export_dir))
    assert config == LlamaConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)
    written = json.loads((export_dir / "config.json").read_text())
    assert written.pop("torch_dtype") == "float32" and written == config.hf_config()
    generation = json.loads((export_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    assert {p.name for p in export_dir.iterdir()} == {
        "notes.txt", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"}


# --- tiny random models ---------------------------------------------------------------------

TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 **{f"self_attn.{p}_proj": f"attn_{g}" for p, g in
                    [("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")]},
                 **{f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}}


def gguf_name(hf: str) -> str:
    if hf in TO_GGUF:
        return TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    module, param = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER_TO_GGUF[module]}.{param}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (its layout for interleaved rope)."""
    pairs = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, pairs, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny(arch: str = "llama", **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)  # logits of about 5
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    return model_class(config_class(**(kwargs | overrides))).eval()


def write_gguf(path: Path, model: transformers.PreTrainedModel,
               qtype: Callable[[str], GGMLType] = lambda name: GGMLType.F32,
               rope_freqs: torch.Tensor | None = None) -> None:
    """``model`` as llama.cpp's converter writes it (names, Q/K permuted for llama), each
    matrix of the type ``qtype`` gives its GGUF name."""
    c, arch = model.config, model.config.model_type
    w = gguf.GGUFWriter(str(path), "llama" if arch == "mistral" else arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = tensor.float().numpy()
        if arch != "qwen2" and ".q_proj." in name:
            x = permute(x, c.num_attention_heads)
        elif arch != "qwen2" and ".k_proj." in name:
            x = permute(x, c.num_key_value_heads)
        t = qtype(gguf_name(name)) if x.ndim == 2 else GGMLType.F32
        w.add_tensor(gguf_name(name), quantize(x, t), raw_dtype=t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load(path: Path | str) -> transformers.PreTrainedModel:
    """A transformers model built from the checkpoint's hf_config() and filled from tensors()."""
    checkpoint = open_checkpoint(str(path))
    cfg = checkpoint.config.hf_config()
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg))
    model.load_state_dict(dict(checkpoint.tensors()), strict=not cfg["tie_word_embeddings"])
    return model.float().eval()


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
    ("mistral", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_hf_config_is_the_model_transformers_builds(arch: str, overrides: dict[str, Any],
                                                    tmp_path: Path) -> None:
    original = tiny(arch, **overrides)
    original.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    checkpoint = open_checkpoint(str(tmp_path))
    state = {k: v for k, v in original.state_dict().items()
             if not (k == "lm_head.weight" and original.config.tie_word_embeddings)}
    assert checkpoint.shapes == {k: tuple(v.shape) for k, v in state.items()}
    for name, tensor in checkpoint.tensors():
        assert torch.equal(tensor, state[name]), name
    rebuilt = load(tmp_path)
    ids = list(range(3, 40))
    assert torch.equal(logits(rebuilt, ids), logits(original, ids))
    assert read_config(str(tmp_path)) == checkpoint.config
    written = checkpoint.config.hf_config()
    del written["head_dim"]  # hidden_size / num_heads when missing
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert read_config(str(tmp_path)) == checkpoint.config  # hf_config round-trips


TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16",
         "attn_output": "BF16", "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "F32",
         "output": "F16"}


def test_gguf_tensor_types(tmp_path: Path) -> None:
    """Every type read, dequantized (or kept, for F32/F16/BF16) as gguf's own reference
    dequantizer gives it, and Q/K un-permuted after dequantizing."""
    model, path = tiny(), tmp_path / "tiny.gguf"
    ggml_type = {k: GGMLType[v] for k, v in TYPES.items()}

    def kind(name: str) -> GGMLType:
        return ggml_type[name.split(".")[-2]]

    write_gguf(path, model, kind)
    checkpoint = open_checkpoint(str(path))
    assert checkpoint.description == "GGUF: 21 tensors, Q4_0 (token_embd Q8_0, norms F32)"
    dtypes = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    for name, tensor in checkpoint.tensors():
        t = kind(gguf_name(name)) if tensor.ndim == 2 else GGMLType.F32
        expected = dequantize(quantize(model.state_dict()[name].numpy(), t), t)
        assert tensor.dtype == dtypes.get(t.name, torch.float32), name
        assert torch.equal(tensor.float(), torch.from_numpy(expected)), name


def test_gguf_qwen2_biases_unpermuted(tmp_path: Path) -> None:
    original = tiny("qwen2")
    write_gguf(tmp_path / "qwen2.gguf", original)
    config = read_config(str(tmp_path / "qwen2.gguf"))
    assert config.architecture == "qwen2" and config.attention_bias
    ids = list(range(3, 40))
    diff = (logits(load(tmp_path / "qwen2.gguf"), ids) - logits(original, ids)).abs().max()
    assert diff < 1e-5, diff


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [
    LLAMA3,  # Llama 3.1's parameters
    LLAMA3 | {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0},  # fitted
    LLAMA3 | {"original_max_position_embeddings": 4096},  # the same band as the one above
])
def test_gguf_llama3_rope_freqs(scaling: dict[str, Any], tmp_path: Path) -> None:
    """Llama 3's rotary survives as its rope_freqs tensor: the recovered rope_scaling makes the
    model that logits far from the origin (where the scaling matters) say the original's."""
    kwargs = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    original = tiny(rope_parameters={"rope_theta": 500000.0, **scaling}, **kwargs)
    factors = llama3_rope_factors(500000.0, 64, scaling)
    write_gguf(tmp_path / "llama3.gguf", original, rope_freqs=factors)
    checkpoint = open_checkpoint(str(tmp_path / "llama3.gguf"))
    assert torch.equal(checkpoint.rope_freqs, factors)
    assert checkpoint.config.rope_scaling["rope_type"] == "llama3"
    if scaling["original_max_position_embeddings"] == 8192:
        assert checkpoint.config.rope_scaling == scaling
    ids, far = list(range(3, 40)), {"position_ids": torch.arange(5000, 5037)[None]}
    diff = (logits(load(tmp_path / "llama3.gguf"), ids, **far)
            - logits(original, ids, **far)).abs().max()
    plain = tiny(rope_parameters={"rope_theta": 500000.0}, **kwargs)
    unscaled = (logits(plain, ids, **far) - logits(original, ids, **far)).abs().max()
    assert diff < 1e-4 and unscaled > 0.01, (diff, unscaled)  # measured: 0 and 0.24


# --- errors ---------------------------------------------------------------------------------

def test_unsupported_tensor_type_is_named(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "q5.gguf"
    write_gguf(path, tiny(), lambda name: GGMLType[
        "Q5_0" if name == "blk.1.ffn_up.weight" else "F32"])
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up\.weight is Q5_0"):
        open_checkpoint(str(path))
    assert export_main([str(path), str(tmp_path / "out")]) == 2
    assert "blk.1.ffn_up.weight is Q5_0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_errors(tmp_path: Path, gguf_path: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    (text := tmp_path / "notes.txt").write_text("not a model")
    (full := tmp_path / "full").mkdir()
    (full / "keep.txt").write_text("mine")
    for args, message in [([str(tmp_path / "absent.gguf"), str(tmp_path / "a")], "no such file"),
                          ([str(text), str(tmp_path / "b")], "is not a GGUF file"),
                          ([gguf_path, str(full)], "is not empty; choose another folder")]:
        assert export_main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("laya-export-hf: error: ") and message in err, err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    # the console script's own process: one line, no traceback
    run = subprocess.run([sys.executable, "-m", "laya_backend_torch.export", str(text),
                          str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and "is not a GGUF file" in run.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_safetensors_streams_any_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    from laya_backend_torch.export import write_safetensors
    from safetensors.torch import load_file

    write_gguf(tmp_path / "tiny.gguf", tiny(), lambda name: GGMLType.Q8_0)
    checkpoint = open_checkpoint(str(tmp_path / "tiny.gguf"))
    write_safetensors(tmp_path / "model.safetensors", checkpoint.shapes, checkpoint.tensors(),
                      dtype, metadata={"source": "tiny.gguf"})
    written = load_file(tmp_path / "model.safetensors")
    assert list(written) == list(checkpoint.shapes)
    for name, tensor in checkpoint.tensors():
        assert written[name].dtype == dtype and torch.equal(written[name], tensor.to(dtype))


def test_damaged_checkpoints_are_refused_with_a_reason(tmp_path: Path) -> None:
    write_gguf(whole := tmp_path / "whole.gguf", tiny())
    data = whole.read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    (header := tmp_path / "header.gguf").write_bytes(data[:200])
    (folder := tmp_path / "folder").mkdir()
    cases = [(cut, "truncated: tensor"), (header, "truncated or corrupt GGUF header"),
             (folder, "has no config.json"), (tmp_path / "absent", "no such file or folder")]
    (gpt2 := tmp_path / "gpt2").mkdir()
    (gpt2 / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    cases.append((gpt2, "is not a model this backend runs"))
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message):
            read_config(str(path))


def test_hostile_headers_are_refused_with_the_shared_readers_reason(tmp_path: Path) -> None:
    """The header is read by laya_core.models.gguf_header: a field that runs out, and a version
    it does not read, are named as the core names them."""
    import hostile_gguf as hg

    huge = hg.with_huge_string_length(hg.embedded(), tmp_path / "huge.gguf")
    with pytest.raises(CheckpointError, match=r"truncated or corrupt GGUF header \(at byte 32, "
                       r"the name of metadata key 0 would take 4611686018427387904 bytes"):
        read_config(str(huge))
    v4 = hg.with_version(hg.embedded(), tmp_path / "v4.gguf", 4)
    with pytest.raises(CheckpointError, match=r"corrupt GGUF header \(GGUF version 4; Laya "
                       r"reads versions 2 and 3\)"):
        read_config(str(v4))
    assert ck.read_metadata(hg.embedded())["llama.attention.layer_norm_rms_epsilon"] == 1e-5
