"""Small model folders as exllamav2's and exllamav3's converters write them: config.json with
its quantization_config, safetensors with EXL2-style tensor names (random bytes: nothing
here runs them), and a byte-level BPE tokenizer.json trained on a few sentences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from safetensors.numpy import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, INTER = 64, 4, 2, 16, 3, 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["Name a colour. Red, green and blue are colours.", "The café serves crème brûlée.",
        "Ünïcode ✓ and emoji 🙂 are bytes too.", "def f(x):\n    return x * 2\n"] * 20


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer.json and its tokenizer_config.json; the vocabulary's size."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    tok.add_tokens(["<think>"])  # an added token that is text
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return int(tok.get_vocab_size(with_added_tokens=True))


def _q_linear(name: str, rows: int, cols: int, rng: np.random.Generator) -> dict[str, Any]:
    """An EXL2 linear layer's tensors: 4-bit weights packed in int32, scales and groups."""
    return {f"{name}.q_weight": rng.integers(0, 2**31, (rows // 8, cols), dtype=np.int32),
            f"{name}.q_scale": rng.integers(0, 2**31, (rows // 128 + 1, cols // 8), dtype=np.int32),
            f"{name}.q_scale_max": rng.random(rows // 128 + 1).astype(np.float16),
            f"{name}.q_groups": np.zeros(2, dtype=np.int16)}


def write_exl2_folder(folder: Path, method: str | None = "exl2", tied: bool = False,
                      **config: Any) -> Path:
    """An EXL2 (or, by ``method``, EXL3 or GPTQ: only config.json says so) folder."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    rng = np.random.default_rng(0)
    tensors: dict[str, Any] = {
        "model.embed_tokens.weight": rng.random((vocab, HIDDEN)).astype(np.float16),
        "model.norm.weight": np.ones(HIDDEN, dtype=np.float16)}
    if not tied:
        tensors.update(_q_linear("lm_head", HIDDEN, vocab, rng))
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for name, rows, cols in (("self_attn.q_proj", HIDDEN, HEADS * HEAD_DIM),
                                 ("self_attn.k_proj", HIDDEN, KV_HEADS * HEAD_DIM),
                                 ("self_attn.v_proj", HIDDEN, KV_HEADS * HEAD_DIM),
                                 ("self_attn.o_proj", HEADS * HEAD_DIM, HIDDEN),
                                 ("mlp.gate_proj", HIDDEN, INTER), ("mlp.up_proj", HIDDEN, INTER),
                                 ("mlp.down_proj", INTER, HIDDEN)):
            tensors.update(_q_linear(f"{p}.{name}", rows, cols, rng))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}.{norm}.weight"] = np.ones(HIDDEN, dtype=np.float16)
    save_file(tensors, str(folder / "model.safetensors"))
    quantization = {} if method is None else {
        "quantization_config": {"quant_method": method, "bits": 4.0, "head_bits": 6}}
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS, "intermediate_size": INTER, "vocab_size": vocab,
        "max_position_embeddings": 2048, "tie_word_embeddings": tied, "torch_dtype": "float16",
        **quantization, **config}))
    return folder


def manifest(folder: Path, backend: str = "exl2", **model: Any) -> str:
    """A manifest serving ``folder`` on port {port}."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in model.items()]
    return "\n".join(['[server]', 'host = "127.0.0.1"', "port = {port}", "", "[[models]]",
                      'name = "exl"', f'backend = "{backend}"', f'path = "{folder}"',
                      "max_seq_len = 1024", "max_num_seqs = 2", *lines, ""])
