"""Stage "models": random-weight Llama models as Hugging Face folders, made where they run.

    python tools/gpu_check/make_models.py 1b 8b

No weights can be downloaded on the GPU machine, so each model is built by transformers
from its config, initialised on the device in bfloat16 (transformers' own init: normal,
std 0.02), and saved as safetensors beside a tokenizer made here. The tokenizer is a
byte-level BPE trained on the repository's documents (1,024 tokens), padded with filler
tokens to the model's whole vocabulary (a random model samples any id, and every id must
decode) and ending in ChatML's special tokens; tokenizer_config.json holds a ChatML chat
template. config.json also carries the rotary settings under the legacy keys (rope_theta,
rope_scaling), which readers older than transformers 5 (exllamav2 0.3) look for.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import common

TRAINED_TOKENS = 1024
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids: the trained tokens,
    then fillers (never produced by encoding, each decoding to its own ASCII text), then the
    special tokens in the last ids, as Llama 3 keeps them above its text tokens. Encoding
    adds the BOS token, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(common.sample_texts(), trainer)
    spec = json.loads(hf.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    first_special = vocab_size - len(SPECIALS)
    if len(vocab) > first_special:
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold {len(vocab)} trained "
                         f"and {len(SPECIALS)} special tokens")
    for i in range(len(vocab), first_special):
        vocab[f"<filler{i}>"] = i
    spec["added_tokens"] = [
        {"id": first_special + k, "content": text, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for k, text in enumerate(SPECIALS)]
    full = Tokenizer.from_str(json.dumps(spec))
    bos = SPECIALS[0]
    full.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, first_special)])
    return full


def write_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json in ``folder``; the special tokens' ids."""
    hf = make_tokenizer(vocab_size)
    hf.save(str(folder / "tokenizer.json"))
    ids = {text: hf.token_to_id(text) for text in SPECIALS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
              "add_eos_token": False, "bos_token": "<|begin_of_text|>",
              "eos_token": "<|im_end|>", "pad_token": "<|end_of_text|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 131072,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return ids


def llama_config(shape: dict[str, Any], special: dict[str, int]) -> Any:
    import transformers

    kwargs = {k: v for k, v in shape.items() if k != "rope"}
    kwargs |= {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
               "bos_token_id": special["<|begin_of_text|>"],
               "eos_token_id": [special["<|im_end|>"], special["<|end_of_text|>"]]}
    rope = shape["rope"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = dict(rope)
    else:
        kwargs["rope_theta"] = rope["rope_theta"]
        kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return transformers.LlamaConfig(**kwargs)


def add_legacy_rope_keys(folder: Path, rope: dict[str, Any]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    path.write_text(json.dumps(config, indent=1) + "\n")


def make(size: str) -> dict[str, Any]:
    """Build, initialise and save one model; what it took."""
    import torch
    import transformers

    name = common.shape_name(size)
    shape = common.SHAPES[name]
    folder = common.model_dir(size)
    folder.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(folder, shape["vocab_size"])
    config = llama_config(shape, special)
    torch.manual_seed(0)
    start = time.monotonic()
    with torch.device(common.device()):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    built = time.monotonic() - start
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder, max_shard_size="5GB")
    add_legacy_rope_keys(folder, shape["rope"])
    params = sum(p.numel() for p in model.parameters())
    del model
    if common.device() == "cuda":
        torch.cuda.empty_cache()
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    common.log(f"{name}: {params / 1e9:.2f} B parameters, {files / 2**30:.2f} GiB of "
               f"safetensors in {folder}")
    return {"path": str(folder), "parameters": params, "safetensors_bytes": files,
            "init_s": round(built, 1), "total_s": round(time.monotonic() - start, 1)}


def main(sizes: list[str]) -> None:
    with common.stage("models") as numbers:
        for size in sizes:
            numbers[common.shape_name(size)] = make(size)


if __name__ == "__main__":
    main(sys.argv[1:] or ["1b", "8b"])
