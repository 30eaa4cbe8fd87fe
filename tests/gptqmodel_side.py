"""gptqmodel, run in a process of its own: it writes act-order GPTQ folders, and it is the
reference that reads GPTQ and AWQ folders back. Run by tests/quantized_folders.py with the
side install on its path (``make install`` puts it in ``.venv/gptqmodel-ref``, without its
pinned numpy and transformers: the suite's own are used).

    python gptqmodel_side.py quantize HF_FOLDER OUT_FOLDER '{"bits": 4, ...}'
    python gptqmodel_side.py reference '{"folders": {NAME: [FOLDER, BACKEND]},
        "prompts": [[ids]], "greedy": N, "greedy_prompts": K}' OUT

``quantize`` calibrates on a few lines of text (GPTQ's Hessians) and saves the folder.
``reference`` saves, with torch.save, the checked layers' matrices [out, in] as gptqmodel's
kernel computes them in float16 (the layer applied to the identity), each prompt's logits
(bfloat16 weights and activations: its kernels take no float32) and, for the first K
prompts, the logits of N greedy steps [N, vocab] (each step's token the arg-max of the row
before, end tokens too), for each folder by its name.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

CHECKED_LAYERS = ("model.layers.0.", "model.layers.29.")
CALIBRATION = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a small robot who wanted to learn to paint.",
] * 4


def quantize(hf: str, out: str, config: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    model = GPTQModel.load(hf, QuantizeConfig(**json.loads(config)), device="cpu")
    model.quantize(CALIBRATION, batch_size=1)
    model.save(out)


def reference(spec: str, out: str) -> None:
    from gptqmodel import BACKEND, GPTQModel

    asked = json.loads(spec)
    found: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for name, (folder, backend) in asked["folders"].items():
            kind = getattr(BACKEND, backend)
            one: dict[str, Any] = {"weights": {}, "logits": [], "greedy": []}
            model = GPTQModel.load(folder, backend=kind, device="cpu",
                                   dtype=torch.float16).model
            for layer_name, layer in model.named_modules():
                if layer_name.startswith(CHECKED_LAYERS) and layer_name.endswith("_proj"):
                    eye = torch.eye(layer.in_features, dtype=torch.float16)
                    one["weights"][layer_name + ".weight"] = layer(eye).T.contiguous()
            model = GPTQModel.load(folder, backend=kind, device="cpu",
                                   dtype=torch.bfloat16).model
            for i, ids in enumerate(asked["prompts"]):
                first = model(torch.tensor([ids]), use_cache=True)
                one["logits"].append(first.logits[0].float())
                if i >= asked["greedy_prompts"]:
                    continue
                rows, past = [first.logits[0, -1].float()], first.past_key_values
                while len(rows) < asked["greedy"]:
                    step = model(torch.tensor([[int(rows[-1].argmax())]]),
                                 past_key_values=past, use_cache=True)
                    rows.append(step.logits[0, -1].float())
                    past = step.past_key_values
                one["greedy"].append(torch.stack(rows))
            found[name] = one
    torch.save(found, out)


if __name__ == "__main__":
    {"quantize": quantize, "reference": reference}[sys.argv[1]](*sys.argv[2:])
