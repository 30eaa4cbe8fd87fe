"""``laya-export-hf MODEL.gguf OUT_DIR``: a GGUF file written out as a Hugging Face folder.

The folder (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json) loads in transformers as the architecture's *ForCausalLM, so a GGUF
model can be compared with, fine-tuned or served by tools that read only Hugging Face
checkpoints. The weights are ``open_checkpoint(gguf).tensors()``: Hugging Face names, Q and K
un-permuted, quantized tensors dequantized (float32 keeps them exactly). They are streamed
into the safetensors file one tensor at a time, so a model larger than memory exports too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from laya_backend_torch.checkpoint import CheckpointError, open_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ExportError(Exception):
    """Something the user can fix (a path, a flag); said as the command's error message."""


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; 0 once the folder is written, 2 (and one line on stderr) when the
    input or the output folder is not usable."""
    args = _parser().parse_args(argv)
    try:
        export(Path(args.gguf), Path(args.out_dir), DTYPES[args.dtype], force=args.force)
    except (ExportError, CheckpointError) as e:
        print(f"laya-export-hf: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder
        where = f"{e.filename}: " if e.filename else ""
        print(f"laya-export-hf: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} ({args.dtype})")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laya-export-hf",
        description="Write a GGUF model (Llama, Mistral, Qwen2) as a Hugging Face folder: "
                    "config.json, model.safetensors, generation_config.json and the tokenizer.")
    parser.add_argument("gguf", metavar="MODEL.gguf", help="the GGUF file to read")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of the written weights (default float32, which holds "
                             "Q8_0/Q4_0/Q4_1/F16/BF16 values exactly)")
    parser.add_argument("--force", action="store_true",
                        help="write into OUT_DIR even though it is not empty")
    return parser


def export(gguf: Path, out_dir: Path, dtype: torch.dtype, *, force: bool = False) -> None:
    """Write ``gguf`` as a Hugging Face folder; every check runs before anything is written."""
    if not gguf.is_file():
        raise ExportError(f"no such file: {gguf}")
    with gguf.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ExportError(f"{gguf} is not a GGUF file (it does not start with GGUF)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"{out_dir} is not empty; choose another folder or pass --force")
    checkpoint = open_checkpoint(str(gguf))  # checks names, shapes and tensor types
    config = checkpoint.config
    from laya_backend_torch.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(gguf)
    except ValueError as e:
        raise ExportError(f"{gguf}: cannot build its tokenizer: {e}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = config.hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    _write_json(out_dir / "config.json", hf)
    write_safetensors(out_dir / "model.safetensors", checkpoint.shapes, checkpoint.tensors(),
                      dtype, metadata={"source": gguf.name,
                                       "checkpoint": checkpoint.description})
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    tokenizer.save(out_dir, model_max_length=config.max_position_embeddings)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                      tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of ``tensors`` (which come in ``shapes`` order), converted to
    ``dtype``. The header is laid out from the shapes first, so each tensor is written and
    dropped as it comes (``safetensors.torch.save_file`` wants them all in memory at once).
    The file appears under its name only when complete."""
    item = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    start = 0
    for name, shape in shapes.items():
        end = start + math.prod(shape) * item
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [start, end]}
        start = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, tensor), (expected, shape) in zip(tensors, shapes.items(), strict=True):
            if name != expected or tuple(tensor.shape) != shape:
                raise AssertionError(f"{name} {list(tensor.shape)} came where {expected} "
                                     f"{list(shape)} was laid out")
            f.write(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
    os.replace(partial, path)


def _write_json(path: Path, value: dict[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
