"""The model's tokenizer as Laya's front end uses it, read from the folder's tokenizer.json
with Hugging Face ``tokenizers``, and what the chat layer needs to know of the vocabulary
(``ModelInfo``: chat template, BOS/EOS, end-of-generation tokens).

The libraries' own tokenizers give each token's text decoded, which loses the bytes of a
token that ends inside a UTF-8 character; Laya's detokenizer needs those bytes, so they are
taken from the vocabulary: byte-level BPE texts map back to bytes through GPT-2's table,
SentencePiece texts turn ``▁`` into a space and ``<0xNN>`` into byte NN. Added tokens are
their own text, special ones none.

``tokenizers`` encodes under a read lock, so any number of threads may encode at once; a
second instance does ``parse_special=False`` (the flag is a property: flipping it per call
would race).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import tokenizers

from laya_core.backend import ModelInfo
from laya_core.models.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: printable bytes are their own character,
    the others were moved to U+0100 and up, in order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, moved = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], moved = chr(0x100 + moved), moved + 1
    return {c: b for b, c in chars.items()}


BYTE_OF_CHAR = _gpt2_byte_of_char()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class FolderTokenizer(Tokenizer):
    """A folder's tokenizer.json behind Laya's interface; see the module docstring."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._plain = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._plain.encode_special_tokens = True
        spec = json.loads(self._hf.to_str())
        self._byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self._texts: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for text, i in vocab.items():
            self._texts[i] = text
        self._added = {i: t.special for i, t in self._hf.get_added_tokens_decoder().items()}
        self._special = frozenset(t.content for t in self._hf.get_added_tokens_decoder().values()
                                  if t.special)
        self._pieces: dict[int, bytes] = {}  # a race only computes a piece twice
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.add_bos = self.add_eos = False

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def special_tokens(self) -> frozenset[str]:
        return self._special

    def token_id(self, text: str | None) -> int | None:
        return None if not text else self._hf.token_to_id(text)

    def adds_itself(self) -> list[int]:
        """What the file's own post-processor adds to a text (BOS, EOS), as ids."""
        return list(self._hf.encode("", add_special_tokens=True).ids)

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        hf = self._hf if parse_special else self._plain
        # A batch of one: tokenized without the GIL, which encode() would hold throughout.
        ids = list(hf.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < len(self._texts):
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        text = self._texts[token_id]
        if text is None or self._added.get(token_id):
            return b""  # an id nothing names, or a control token
        if token_id in self._added:
            return text.encode()  # an added token that is text, such as <think>
        if self._byte_level:
            if all(c in BYTE_OF_CHAR for c in text):
                return bytes(BYTE_OF_CHAR[c] for c in text)
            return text.encode()
        if m := _BYTE_TOKEN.fullmatch(text):
            return bytes((int(m.group(1), 16),))
        return text.replace("▁", " ").encode()


def _token_text(value: object) -> str | None:
    """tokenizer_config.json's bos_token or eos_token: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> set[int]:
    items = value if isinstance(value, list) else [value]
    return {v for v in items if isinstance(v, int) and not isinstance(v, bool)}


def load_tokenizer(folder: str | Path, description: str) -> tuple[FolderTokenizer, ModelInfo]:
    """The folder's tokenizer and what the front end needs to know of it."""
    folder = Path(folder)
    tok = FolderTokenizer(folder)
    tc = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    tok.bos_id, tok.eos_id = tok.token_id(bos), tok.token_id(eos)
    if "add_bos_token" in tc:
        tok.add_bos, tok.add_eos = bool(tc["add_bos_token"]), bool(tc.get("add_eos_token"))
    else:  # what the file's own post-processor adds
        tok.add_bos = tok.bos_id is not None and tok.adds_itself()[:1] == [tok.bos_id]
    # What Hugging Face stops on: generation_config.json's eos_token_id (one or a list),
    # config.json's, and the tokenizer's EOS.
    eog = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
    eog |= _ids(config.get("eos_token_id")) | _ids(tok.eos_id)
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    info = ModelInfo(
        n_ctx_train=int(config.get("max_position_embeddings") or 4096),
        vocab_size=tok.vocab_size, eog_token_ids=frozenset(eog),
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos or "", eos_token=eos or "", add_bos=tok.add_bos,
        description=description, special_tokens=tok.special_tokens)
    return tok, info
