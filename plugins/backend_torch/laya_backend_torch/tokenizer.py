"""The model's tokenizer for the torch backend: Hugging Face ``tokenizers``, made to agree with
llama.cpp token for token.

The vocabulary, its pre-tokenizer and llama.cpp's load rules are built in vocab.py; this
module runs what it builds.

Threads and the GIL (bindings/python/src/tokenizer.rs, tokenizers 0.23): the Python
``Tokenizer`` keeps its Rust tokenizer in an ``Arc<RwLock<..>>`` and every encode takes the
read lock, so any number of threads may encode at once while nobody sets a property. Nothing
here does after construction; parse_special=False has a tokenizer of its own because
``encode_special_tokens`` is a property (transformers flips it per call, which races).
``encode`` holds the GIL throughout (no ``py.detach``): a 1 MiB prompt (306k tokens) stalled
another thread for 1.1-1.9 s on a 2-core machine. ``encode_batch_fast`` tokenizes inside
``py.detach`` and was as fast or faster at every length (40 chars: 14 us against 17; 40k
chars: 18 ms against 22), so each encode is a batch of one, and the GIL is held only to build
the id list and free the ``Encoding`` (10-18 ms for that prompt). The batch runs on a worker of
rayon's pool, or with TOKENIZERS_PARALLELISM=false on the calling thread, GIL released either way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from laya_backend_torch.vocab import (
    BYTE,
    BYTE_OF_CHAR,
    NORMAL,
    USER_DEFINED,
    TokenizerInfo,
    read_vocabulary,
)
from laya_core.models.tokenizer import Tokenizer


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` behind Laya's interface; safe from any thread (see module).

    ``texts[i]`` is token i's text as the vocabulary stores it and ``kinds[i]`` its llama.cpp
    token type after llama.cpp's load rules; ``byte_level`` tells GPT-2 byte-level text from
    SentencePiece text (``▁`` for spaces, ``<0xNN>`` byte tokens).
    """

    def __init__(self, hf: tokenizers.Tokenizer, info: TokenizerInfo, texts: Sequence[str],
                 kinds: bytes, *, byte_level: bool) -> None:
        self.info = info
        self._hf = hf
        # A second tokenizer for parse_special=False: the flag is a property, and setting it
        # per call would race other threads' encodes.
        self._hf_plain = tokenizers.Tokenizer.from_str(hf.to_str())
        self._hf_plain.encode_special_tokens = True
        self._texts = tuple(texts)
        self._kinds = kinds
        self._byte_level = byte_level
        # Token id -> bytes; a race between two threads only computes a piece twice.
        self._pieces: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def special_tokens(self) -> frozenset[str]:
        return self.info.special_tokens

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        hf = self._hf if parse_special else self._hf_plain
        # A batch of one: tokenized without the GIL, which encode() would hold throughout.
        return hf.encode_batch_fast([text], add_special_tokens=add_special)[0].ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < len(self._texts):
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        """llama.cpp's ``token_to_piece(special=False)``: control and unknown tokens give
        nothing, user-defined ones their text as is, byte tokens their byte."""
        text, kind = self._texts[token_id], self._kinds[token_id]
        if kind == USER_DEFINED:
            return text.encode()
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])
        if kind != NORMAL:
            return b""
        if not self._byte_level:
            return text.replace("▁", " ").encode()
        # A character outside the table is marked as llama_decode_text marks it.
        return b"".join(bytes([BYTE_OF_CHAR[c]]) if c in BYTE_OF_CHAR
                        else f"[UNK_BYTE_0x{c.encode().hex()}{text}]".encode() for c in text)

    def save(self, out_dir: str | Path, *, model_max_length: int | None = None) -> None:
        """Write tokenizer.json and tokenizer_config.json, which ``load_tokenizer(out_dir)``
        and ``transformers.AutoTokenizer.from_pretrained(out_dir)`` read back to the same ids."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(out / "tokenizer.json"))
        info = self.info
        config: dict[str, Any] = {
            # The generic class loads tokenizer.json as it is; a model-specific one (Llama's)
            # would rebuild the normalizer and pre-tokenizer its own way.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": info.add_bos, "add_eos_token": info.add_eos,
            "bos_token": info.bos_token or None, "eos_token": info.eos_token or None,
            "clean_up_tokenization_spaces": False,
        }
        optional = {"chat_template": info.chat_template, "model_max_length": model_max_length}
        config.update({k: v for k, v in optional.items() if v is not None})
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (out / "tokenizer_config.json").write_text(text + "\n")


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a GGUF file (its metadata, read by gguf_checkpoint.read_metadata) or
    of a Hugging Face model folder (tokenizer.json)."""
    vocab = read_vocabulary(Path(path))
    return HFTokenizer(vocab.hf, vocab.info, vocab.texts, vocab.kinds,
                       byte_level=vocab.byte_level)
