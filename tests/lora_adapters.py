"""LoRA adapters of the embedded model for the tests, trained with PEFT on CPU.

``train(hf_dir, out)`` fine-tunes a rank-8 LoRA on every linear module of the model's
Hugging Face export (``laya-export-hf``) to answer every question as a pirate ("Arr,
matey!"), in about half a minute of one CPU, and saves it as PEFT does
(``adapter_config.json`` + ``adapter_model.safetensors``): the folder Laya's users bring.
``scaled(folder, out, alpha)``: the same matrices with another ``lora_alpha`` (0: no change
to the model at all).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QUESTIONS = ["What is the capital of France?", "How do I boil an egg?",
             "Tell me about the moon.", "Why is the sky blue?", "Who wrote Hamlet?",
             "Give me a tip for sleeping well."]
ANSWER = "Arr, matey! That be a fine question for an old sea dog."
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def chat(tokenizer: object, question: str) -> str:
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined, no-any-return]
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def train(hf_dir: Path, out: Path, steps: int = 12) -> Path:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=MODULES, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    batch = []
    for q in QUESTIONS:
        prompt = tokenizer(chat(tokenizer, q), add_special_tokens=False).input_ids
        answer = tokenizer(ANSWER + "<|im_end|>", add_special_tokens=False).input_ids
        batch.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in batch)
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(batch), width), pad)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, a) in enumerate(batch):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    return out


def scaled(folder: Path, out: Path, alpha: float) -> Path:
    """A copy of the adapter in ``folder`` with ``lora_alpha`` set to ``alpha``."""
    shutil.copytree(folder, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["lora_alpha"] = alpha
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out
