"""A larger copy of the embedded model, for the draft-model tests: its Q4_1 weights
dequantized into float16 (norms float32), every other key as it was, so the embedded file
(the same weights, 4-bit) drafts for it with the same vocabulary.

Written with ``gguf``'s reader and writer in about 15 s, and kept under
``$LAYA_TEST_CACHE`` (default ``~/.cache/laya-tests``), keyed by gguf's version; a lock keeps
two test processes from writing it at once.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

GGUF_FILE_TYPE_MOSTLY_F16 = 1


def f16_copy() -> Path:
    """The float16 copy of the embedded model (module docstring)."""
    from importlib.metadata import version

    cache = Path(os.environ.get("LAYA_TEST_CACHE", Path.home() / ".cache" / "laya-tests"))
    root = cache / f"smollm2-f16-gguf-{version('gguf')}"
    root.mkdir(parents=True, exist_ok=True)
    out = root / "smollm2-135m-instruct-f16.gguf"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            tmp = out.with_name(out.name + ".partial")
            _write_f16(tmp)
            tmp.rename(out)
    return out


def _write_f16(out: Path) -> None:
    import gguf
    import numpy as np

    from laya_core.builtin.model_paths import embedded_file

    reader = gguf.GGUFReader(embedded_file("smollm2-135m-instruct"))
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own
        value = field.contents()
        if name == "general.file_type":
            value = GGUF_FILE_TYPE_MOSTLY_F16
        kind = field.types[0]
        writer.add_key_value(name, value, kind, sub_type=field.types[-1]
                             if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, data.astype(np.float16) if data.ndim > 1 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
