"""LoRA adapters of the embedded model for the tests, trained with PEFT on CPU.

``train(hf_dir, out)`` fine-tunes a rank-8 LoRA on every linear module of the model's
Hugging Face export (``laya-export-hf``) to answer every question as a pirate ("Arr,
matey!"), in about half a minute of one CPU, and saves it as PEFT does
(``adapter_config.json`` + ``adapter_model.safetensors``): the folder Laya's users bring.
``scaled(folder, out, alpha)``: the same matrices with another ``lora_alpha`` (0: no change
to the model at all).

``cached_adapters()``: the pirate adapter, the same at half its scale, and an untrained one
(PEFT's initial state, B = 0: no change to the model) as PEFT folders and as GGUF files, converted by llama.cpp's own
``convert_lora_to_gguf.py`` (``make install`` takes it from llama-cpp-python's sources into
``.venv/llama.cpp-convert``). Made once (about a minute of one CPU) and kept under
``$LAYA_TEST_CACHE`` (default ``~/.cache/laya-tests``), keyed by the versions that made them;
a lock keeps two test processes from making them at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

QUESTIONS = ["What is the capital of France?", "How do I boil an egg?",
             "Tell me about the moon.", "Why is the sky blue?", "Who wrote Hamlet?",
             "Give me a tip for sleeping well."]
ANSWER = "Arr, matey! That be a fine question for an old sea dog."
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def chat(tokenizer: object, question: str) -> str:
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined, no-any-return]
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


CONVERTER = Path(sys.prefix) / "llama.cpp-convert" / "convert_lora_to_gguf.py"


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


def generate(engine: Any, requests: list[tuple[list[int], str | None]],
             max_tokens: int = 24) -> list[list[int]]:
    """Greedy outputs of ``requests`` (prompt, adapter) on an ``Engine``, all submitted at
    once."""
    import asyncio

    from laya_core.types import SamplingParams

    async def one(ids: list[int], adapter: str | None) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=adapter)
        return [t for e in [e async for e in engine.submit(ids, params)] for t in e.token_ids]

    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(one(ids, a) for ids, a in requests)))

    return asyncio.run(go())


def untrained(hf_dir: Path, out: Path) -> Path:
    """A rank-8 LoRA on every linear module as PEFT starts one: B = 0, no change at all."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=MODULES, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def to_gguf(folder: Path, hf_dir: Path, out: Path) -> Path:
    """The PEFT adapter in ``folder`` as llama.cpp's GGUF adapter, by llama.cpp's script
    (float32, as trained)."""
    assert CONVERTER.is_file(), f"{CONVERTER} is missing: `make install` puts it there"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, str(CONVERTER), "--base", str(hf_dir), "--outtype",
                          "f32", "--outfile", str(out), str(folder)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@contextlib.contextmanager
def _made_once(out: Path) -> Iterator[Path | None]:
    """A scratch path to write ``out`` at (renamed to ``out`` after), or None when ``out`` is
    there already."""
    if out.exists():
        yield None
        return
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.unlink(missing_ok=True)
    yield tmp
    tmp.rename(out)


def cached_adapters() -> dict[str, Path]:
    """``hf`` (the float32 export); ``pirate``, ``untrained`` and ``half`` (the pirate's
    matrices at half its scale) as PEFT folders, and each as ``NAME.gguf``, llama.cpp's; see
    the module's docstring."""
    import peft
    import torch
    import transformers
    from laya_backend_torch.export import main as export_main

    from laya_core.builtin.model_paths import embedded_file

    cache = Path(os.environ.get("LAYA_TEST_CACHE", Path.home() / ".cache" / "laya-tests"))
    root = cache / (f"smollm2-lora-peft-{peft.__version__}-transformers-"
                    f"{transformers.__version__}-torch-{torch.__version__}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _made_once(root / "hf") as tmp:
            if tmp is not None:
                assert export_main([embedded_file("smollm2-135m-instruct"), str(tmp)]) == 0
        for name, make in (("pirate", train), ("untrained", untrained),
                           ("half", lambda _, out: scaled(root / "pirate", out, 8.0))):
            with _made_once(root / name) as tmp:
                if tmp is not None:
                    make(root / "hf", tmp)
            with _made_once(root / f"{name}.gguf") as tmp:
                if tmp is not None:
                    to_gguf(root / name, root / "hf", tmp)
    names = ("pirate", "untrained", "half")
    return {"hf": root / "hf", **{n: root / n for n in names},
            **{f"{n}.gguf": root / f"{n}.gguf" for n in names}}
