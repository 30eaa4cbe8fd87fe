"""What every stage of tools/gpu_check.sh shares: where it works, which device and model
shapes it uses, and how it records its outcome.

Each stage is a program (``python tools/gpu_check/STAGE.py``) run by the shell script under a
time limit. It writes one result, ``$GPU_CHECK_WORK/results/NAME.json``: a status (PASS,
FAIL or SKIPPED), a reason a person can act on, and its numbers. A stage that dies or runs
out of time writes nothing, and the script records that for it, so one broken stage never
hides the others. ``GPU_CHECK_DRY=1`` runs the same plumbing on a CPU with tiny models.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
REPO = Path(__file__).resolve().parents[2]

# Model shapes (Hugging Face LlamaConfig keys). "1b" and "8b" are Llama-3.2-1B's and
# Llama-3.1-8B's; the dry run's stand-ins keep their structure (GQA, tied or untied head,
# llama3 rotary) at a size a CPU runs in seconds.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
           "tie_word_embeddings": True, "rope": {**_LLAMA3_ROPE, "factor": 32.0}},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "tie_word_embeddings": False, "rope": {**_LLAMA3_ROPE, "factor": 8.0}},
    "tiny-1b": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 2048,
                "tie_word_embeddings": True, "rope": {**_LLAMA3_ROPE, "factor": 32.0}},
    "tiny-8b": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 2048,
                "tie_word_embeddings": False, "rope": {**_LLAMA3_ROPE, "factor": 8.0}},
}


def dry_run() -> bool:
    return os.environ.get("GPU_CHECK_DRY", "0") not in ("", "0")


def work_dir() -> Path:
    return Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check_work"))


def device() -> str:
    return "cpu" if dry_run() else "cuda"


def shape_name(size: str) -> str:
    """"1b" or "8b" as this run makes it: the real shape, or its tiny stand-in."""
    return f"tiny-{size}" if dry_run() else size


def model_dir(size: str) -> Path:
    return work_dir() / "models" / shape_name(size)


def result_path(name: str) -> Path:
    return work_dir() / "results" / f"{name}.json"


def write_result(name: str, status: str, reason: str = "", **numbers: Any) -> None:
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "status": status, "reason": reason, "numbers": numbers}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)  # whole or absent: the script reads it to see whether the stage ended


class StageFailed(Exception):
    """A check that did not hold; its message is the stage's reason."""


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    # `timeout` sends SIGTERM: turn it into an exception so that `finally` blocks stop the
    # servers and release the GPU before the stage exits.
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def stage(name: str) -> Iterator[dict[str, Any]]:
    """Run a stage's body; the numbers it puts in the yielded dict are recorded whatever
    happens. Returning normally is PASS, unless the body sets ``numbers["status"]``;
    ``StageFailed`` and any other exception are FAIL with their message."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    numbers: dict[str, Any] = {}
    start = time.monotonic()
    status, reason = PASS, ""
    try:
        yield numbers
        status = numbers.pop("status", PASS)
        reason = numbers.pop("reason", "")
    except StageFailed as e:
        status, reason = FAIL, str(e)
    except KeyboardInterrupt as e:
        status, reason = FAIL, f"stopped ({e}): out of time"
    except Exception as e:  # noqa: BLE001 - any failure is this stage's result, not a crash
        traceback.print_exc()
        status, reason = FAIL, f"{type(e).__name__}: {str(e)[:400]}"
    finally:
        numbers.pop("status", None)
        numbers.pop("reason", None)
        numbers["seconds"] = round(time.monotonic() - start, 1)
        write_result(name, status, reason, **numbers)
        print(f"gpu_check: {name}: {status} {reason}".rstrip(), flush=True)


def transformers_model(folder: Path, dtype: str) -> Any:
    """transformers' LlamaForCausalLM of ``folder`` in ``dtype``, on this run's device (read
    straight onto the GPU there)."""
    import torch
    import transformers

    if device() == "cuda":
        return transformers.LlamaForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), device_map="cuda").eval()
    return transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype)).eval()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sample_texts() -> list[str]:
    """Prose from the repository's own documents (they travel with the tree): the text the
    tokenizer is trained on and the prompts are cut from."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "spec").glob("*.md"))]
    return [f.read_text(encoding="utf-8") for f in files if f.is_file()]
