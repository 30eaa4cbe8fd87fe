"""The prompts' tokenizer of an ExLlama folder: its tokens' bytes (a character split over
several byte tokens comes out whole through Laya's detokenizer), special tokens with no
bytes, added text tokens as their text, markup parsed or kept as text, and what the chat
layer needs (template, EOS, end-of-generation ids, BOS) from the folder's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from exl2_folders import CHATML, write_exl2_folder
from laya_backend_exl2.tokenizer import FolderTokenizer, load_tokenizer

from laya_core.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_exl2_folder(tmp_path_factory.mktemp("tok") / "m")


def detokenized(tok: FolderTokenizer, ids: list[int]) -> str:
    d = IncrementalDetokenizer(tok.token_bytes)
    return "".join(d.add(t)[0] for t in ids) + d.flush()


@pytest.mark.parametrize("text", ["Name a colour.", "crème brûlée ✓", "字 not in training",
                                  "emoji 🙂🙃 end", "def f(x):\n    return x\n"])
def test_text_comes_back_byte_for_byte(folder: Path, text: str) -> None:
    tok, _ = load_tokenizer(folder, "")
    ids = tok.encode(text, add_special=True)
    assert detokenized(tok, ids) == text == tok.decode(ids)


def test_a_character_split_over_byte_tokens_has_their_bytes(folder: Path) -> None:
    tok, _ = load_tokenizer(folder, "")
    ids = tok.encode("字", add_special=False)
    assert len(ids) == 3 and b"".join(map(tok.token_bytes, ids)) == "字".encode()


def test_special_tokens_are_markup_or_text(folder: Path) -> None:
    tok, info = load_tokenizer(folder, "")
    (end,) = tok.encode("<|im_end|>", add_special=False)
    assert tok.token_bytes(end) == b"" and end in info.eog_token_ids
    assert "<|im_end|>" in tok.special_tokens and "<think>" not in tok.special_tokens
    plain = tok.encode("<|im_end|>", add_special=False, parse_special=False)
    assert end not in plain and tok.decode(plain) == "<|im_end|>"
    (think,) = tok.encode("<think>", add_special=False)
    assert tok.token_bytes(think) == b"<think>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_model_info_comes_from_the_folder(folder: Path) -> None:
    tok, info = load_tokenizer(folder, "on cuda:0")
    assert info.chat_template == CHATML and info.eos_token == "<|im_end|>"
    assert info.bos_token == "" and not info.add_bos and info.vocab_size == tok.vocab_size
    assert info.n_ctx_train == 2048 and info.description == "on cuda:0"


def test_bos_and_generation_config_stops(tmp_path: Path) -> None:
    folder = write_exl2_folder(tmp_path / "m")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.update(bos_token={"content": "<|endoftext|>", "special": True}, add_bos_token=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    tok, info = load_tokenizer(folder, "")
    assert info.bos_token == "<|endoftext|>" and info.add_bos
    assert tok.encode("Red", add_special=True)[0] == 0 != tok.encode("Red", add_special=False)[0]
    assert info.eog_token_ids == {0, 1, 2}


def test_a_sentencepiece_vocabulary_has_spaces_and_byte_tokens(tmp_path: Path) -> None:
    """Llama-2's kind: ``▁`` for a space, ``<0xNN>`` byte tokens for what it lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁": 259, "H": 260, "i": 261, "▁H": 262, "▁Hi": 263}
    merges = [("▁", "H"), ("▁H", "i")]
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, byte_fallback=True,
                                                    unk_token="<unk>"))
    hf.normalizer = tokenizers.normalizers.Sequence([
        tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")])
    hf.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse()])
    hf.add_special_tokens(["<s>", "</s>"])
    tmp_path.joinpath("tokenizer.json").write_text(hf.to_str())
    tok = FolderTokenizer(tmp_path)
    ids = tok.encode("Hi é", add_special=False)
    assert tok.token_bytes(263) == b" Hi" and tok.token_bytes(2) == b""
    assert b"".join(map(tok.token_bytes, ids)) == " Hi é".encode()
