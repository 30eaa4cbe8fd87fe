"""Reading a model's shape from a GGUF header, and refusing damaged or hostile files.

Each hostile file is an edited copy of the embedded model (``tests/hostile_gguf.py``); the
reader must refuse it with a ``ModelFileError`` naming the problem or the metadata key. What
only llama.cpp refuses (it would abort the process) is its plugin's check
(tests/backend_llamacpp/test_metadata_limits.py), which the reader runs when given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hostile_gguf as hg
import pytest

from laya_core.models.checks import check_metadata
from laya_core.models.files import ModelFileError, model_file_problem, read_shape


def refusal(path: Path) -> str:
    with pytest.raises(ModelFileError) as info:
        read_shape(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_the_embedded_file_reads_its_shape() -> None:
    shape = read_shape(hg.embedded())
    assert (shape.architecture, shape.n_layers, shape.n_heads, shape.n_kv_heads) == (
        "llama", 30, 9, 3)
    assert (shape.head_dim_k, shape.hidden_size, shape.vocab_size) == (64, 576, 49152)
    assert shape.weights_bytes == 96576768 and shape.matrix_types == {"q4_1"}


@pytest.mark.parametrize("n_bytes", [2**20, 100, 24, 4])
def test_a_truncated_header_is_refused(tmp_path: Path, n_bytes: int) -> None:
    message = refusal(hg.truncated(hg.embedded(), tmp_path / "cut.gguf", n_bytes))
    assert "truncated or corrupt" in message and f"file size {n_bytes} bytes" in message


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    message = refusal(hg.truncated(hg.embedded(), tmp_path / "cut.gguf", 50_000_000))
    assert "truncated: tensor blk.16.ffn_down.weight ends at byte" in message


def test_a_huge_string_length_is_bounded_by_the_file_size(tmp_path: Path) -> None:
    message = refusal(hg.with_huge_string_length(hg.embedded(), tmp_path / "huge.gguf"))
    assert "the name of metadata key 0 would take 4611686018427387904 bytes" in message


@pytest.mark.parametrize("version", [0, 1, 4, 999])
def test_only_gguf_versions_2_and_3_are_read(tmp_path: Path, version: int) -> None:
    message = refusal(hg.with_version(hg.embedded(), tmp_path / "v.gguf", version))
    assert f"GGUF version {version}; Laya reads versions 2 and 3" in message


def test_version_2_is_read(tmp_path: Path) -> None:
    assert read_shape(hg.with_version(hg.embedded(), tmp_path / "v2.gguf", 2)).n_layers == 30


@pytest.mark.parametrize(("key", "value", "kind", "said"), [
    ("llama.attention.head_count", 0, "u32", "llama.attention.head_count is 0; expected at least 1"),
    ("llama.attention.head_count_kv", 0, "u32", "head_count_kv is 0; expected at least 1"),
    ("llama.attention.head_count_kv", 2, "u32", "must be at least 1 and divide llama.attention.head_count (9)"),
    ("llama.embedding_length", 0, "u32", "llama.embedding_length is 0"),
    ("llama.embedding_length", 577, "u32", "(577) is not a multiple of llama.attention.head_count (9)"),
    ("llama.embedding_length", 585, "u32", "585 but token_embd.weight is 576 wide"),
    ("llama.vocab_size", 0, "u32", "llama.vocab_size is 0: the file has no vocabulary"),
    ("llama.context_length", 0, "u32", "llama.context_length is 0; expected at least 1"),
    ("llama.block_count", 0, "u32", "llama.block_count is 0 but the tensor table has 30 layers"),
    ("llama.block_count", "thirty", "str", "llama.block_count is 'thirty'; expected a whole number"),
    ("llama.attention.head_count", None, "delete", "llama.attention.head_count is missing"),
    ("general.architecture", None, "delete", "general.architecture is missing"),
])
def test_metadata_no_sound_model_has_is_refused(tmp_path: Path, key: str, value: Any,
                                                      kind: str, said: str) -> None:
    path = hg.with_metadata(hg.embedded(), tmp_path / "bad.gguf", key, value, kind)
    assert said in refusal(path)


def test_block_count_must_match_the_tensor_table(tmp_path: Path) -> None:
    path = hg.with_metadata(hg.embedded(), tmp_path / "bad.gguf", "llama.block_count", 1000)
    assert "llama.block_count is 1000 but the tensor table has 30 layers (blk.0 to blk.29)" in (
        refusal(path))


def test_an_edited_copy_with_sound_values_still_reads(tmp_path: Path) -> None:
    path = hg.with_metadata(hg.embedded(), tmp_path / "ok.gguf", "llama.attention.key_length", 64)
    assert read_shape(path).head_dim_k == 64


@pytest.mark.parametrize(("changes", "said"), [
    ({"llama.attention.head_count": [2, 2, 2]}, "head_count has 3 entries; block_count is 2"),
    ({"llama.attention.head_count": [0, 0]}, "head_count is 0 in every layer"),
    ({"llama.attention.head_count": [2, -1]}, "head_count[1] is -1"),
    ({"llama.attention.head_count_kv": [1, 3], "llama.attention.head_count": [2, 2]},
     "head_count_kv is 3 (layer 1)"),
    ({"tokenizer.ggml.tokens": 0}, "tokenizer.ggml.tokens is 0: the file has no vocabulary"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is None"),
    ({"llama.attention.key_length": 0}, "key_length is 0"),
])
def test_check_metadata_limits(changes: dict[str, Any], said: str) -> None:
    with pytest.raises(ModelFileError) as info:
        check_metadata(hg.small_llama(**changes), {})
    assert said in str(info.value)


def test_check_metadata_passes_a_sound_model_with_per_layer_heads() -> None:
    meta = hg.small_llama(**{"llama.attention.head_count": [2, 0],
                          "llama.attention.head_count_kv": [1, 0]})
    assert check_metadata(meta, {"blk.0.attn_q.weight": [8, 8], "blk.1.ssm.weight": [8]}) == (
        "llama")


def test_model_file_problem_refuses_special_files(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert model_file_problem(str(fifo)) == f"{fifo} is not a regular file or a folder"
    assert model_file_problem("/dev/zero") == "/dev/zero is not a regular file or a folder"
    assert model_file_problem(str(tmp_path / "none")) == f"no such file: {tmp_path / 'none'}"
    assert model_file_problem(str(hg.embedded())) is None


def test_a_config_json_with_zero_heads_is_refused(tmp_path: Path) -> None:
    config = {"hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"num_attention_heads \(0\).* must be >= 1"):
        read_shape(tmp_path)
