"""The one GGUF header reader: its options, and the same refusal for every caller.

``test_model_files.py`` covers the hostile files through the core's shape reader; here the
reader's own options (how arrays and float32 values are kept) and its tensor table are checked
against the embedded model.
"""

from __future__ import annotations

from pathlib import Path

import hostile_gguf as hg
import pytest

from laya_core.models.gguf_header import HeaderRunsOut, read_gguf_header


def test_arrays_are_kept_whole_unless_limited_or_skipped() -> None:
    whole = read_gguf_header(hg.embedded()).metadata
    assert len(whole["tokenizer.ggml.tokens"]) == 49152
    assert whole["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>", "<|im_start|>"]
    assert len(whole["tokenizer.ggml.token_type"]) == 49152  # a fixed-size array
    assert whole["general.languages"] == ["en"]

    limited = read_gguf_header(hg.embedded(), keep_items=4096,
                               skip_prefixes=("general.",)).metadata
    assert limited["tokenizer.ggml.tokens"] == limited["tokenizer.ggml.token_type"] == 49152
    assert limited["tokenizer.ggml.merges"] == 48900
    assert limited["general.languages"] == 1  # short, but under a skipped prefix
    assert limited["general.architecture"] == "llama"  # a string, not an array: kept


def test_float32_values_as_stored_or_as_written() -> None:
    key = "llama.attention.layer_norm_rms_epsilon"
    assert read_gguf_header(hg.embedded()).metadata[key] == pytest.approx(1e-5)
    assert read_gguf_header(hg.embedded()).metadata[key] != 1e-5  # the float32 nearest it
    assert read_gguf_header(hg.embedded(), floats_as_written=True).metadata[key] == 1e-5


def test_the_tensor_table_in_ggml_order_from_the_data_start() -> None:
    header = read_gguf_header(hg.embedded())
    embd = header.tensors[0]
    assert (embd.name, embd.dims, embd.type.name, embd.offset) == (
        "token_embd.weight", (576, 49152), "Q8_0", 0)
    assert embd.nbytes == 576 * 49152 // 32 * 34  # Q8_0: 34 bytes a block of 32
    assert header.data_start % 32 == 0 and len(header.tensors) == 272
    last = max(header.tensors, key=lambda t: t.offset)
    assert header.data_start + last.offset + last.nbytes <= header.file_size


def test_a_field_running_out_says_where(tmp_path: Path) -> None:
    path = hg.with_huge_string_length(hg.embedded(), tmp_path / "huge.gguf")
    with pytest.raises(HeaderRunsOut) as info:
        read_gguf_header(path)
    assert info.value.detail.startswith(
        "at byte 32, the name of metadata key 0 would take 4611686018427387904 bytes")
    assert str(info.value) == f"truncated or corrupt: {info.value.detail}"
