"""llama.cpp's tokenizer, called from the HTTP side's worker threads while the engine decodes.

No lock is needed against ``llama_decode``: tokenizing reads only the model's vocabulary,
which llama.cpp builds at load and never changes. In llama-vocab.cpp ``llama_tokenize``
and ``llama_token_to_piece`` take a ``const llama_vocab *`` and end in ``const`` methods
(``impl::tokenize(...) const``, ``impl::token_to_piece(...) const``); the working state of
a tokenize lives in a session object made per call (``llm_tokenizer_bpe_session`` and the
like), the piece cache ``cache_token_to_piece`` is filled once in ``impl::load``, and
unicode.cpp's tables are function-local statics (initialised once, thread-safely, in C++11).
``llama_decode`` writes the context, never the vocabulary. ctypes releases the GIL for the
call, so a long prompt tokenizes beside the decode rather than between its steps.

What does need guarding is the lifetime: ``Backend.close()`` frees the model, vocabulary
included, and a request may still be tokenizing. A :class:`UseGuard` lets close wait for it.
"""

from __future__ import annotations

import ctypes
from typing import Any

from laya_core.models.tokenizer import Tokenizer, UseGuard

_IDS_PER_COPY = 32768  # token ids copied out of llama.cpp's buffer per GIL hold (about 1 ms)
_PIECE_BUF = 256  # bytes; the longest token piece of common vocabularies is far shorter


class LlamaTokenizer(Tokenizer):
    def __init__(self, ll: Any, vocab: Any, vocab_size: int,
                 special_tokens: frozenset[str]) -> None:
        self._ll = ll
        self._vocab = vocab  # const llama_vocab *, owned by the model
        self._vocab_size = vocab_size
        self._special_tokens = special_tokens
        # Token id -> bytes; a race between two threads only computes a piece twice.
        self._pieces: dict[int, bytes] = {}
        self._guard = UseGuard("the model's vocabulary")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> frozenset[str]:
        return self._special_tokens

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        ll = self._ll
        data = text.encode("utf-8")
        capacity = len(data) + 16
        with self._guard.use():
            while True:
                out = (ll.llama_token * capacity)()
                n = ll.llama_tokenize(self._vocab, data, len(data), out, capacity, add_special,
                                      parse_special)
                if n >= 0:
                    break
                capacity = -n
        # In slices: each copy holds the GIL, and a megabyte prompt's 800k ids in one go
        # would stall the event loop for 24 ms.
        ids: list[int] = []
        for start in range(0, n, _IDS_PER_COPY):
            ids += out[start:min(start + _IDS_PER_COPY, n)]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < self._vocab_size:  # llama.cpp would abort the process
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            buf = ctypes.create_string_buffer(_PIECE_BUF)
            with self._guard.use():
                # special=False: control tokens such as <|im_end|> render as nothing.
                n = self._ll.llama_token_to_piece(self._vocab, token_id, buf, _PIECE_BUF, 0,
                                                  False)
            piece = self._pieces[token_id] = buf.raw[: max(n, 0)]
        return piece

    def close(self) -> None:
        """Wait for calls under way and refuse new ones; then the model may be freed."""
        self._guard.close()


def token_text(ll: Any, vocab: Any, token: int) -> str:
    """A token's text as the vocabulary stores it ("" for none, or a negative id)."""
    if token < 0:
        return ""
    text = ll.llama_vocab_get_text(vocab, token)
    return text.decode("utf-8", "replace") if text else ""


def special_texts(ll: Any, vocab: Any, n_vocab: int) -> frozenset[str]:
    """The texts llama.cpp's tokenizer matches as special tokens when parsing specials:
    control, user-defined and unknown tokens (llama-vocab.cpp's special-token cache)."""
    kinds = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED \
        | ll.LLAMA_TOKEN_ATTR_UNKNOWN
    texts = (token_text(ll, vocab, t) for t in range(n_vocab)
             if ll.llama_vocab_get_attr(vocab, t) & kinds)
    return frozenset(t for t in texts if t)


class VocabularyTokenizer(LlamaTokenizer):
    """A tokenizer that owns a model loaded with ``vocab_only``: the vocabulary and none of
    the weights (for a front end whose replica runs in a worker process)."""

    def __init__(self, ll: Any, path: str) -> None:
        params = ll.llama_model_default_params()
        params.vocab_only = True
        model = ll.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}")
        self._model = model
        vocab = ll.llama_model_get_vocab(model)
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        super().__init__(ll, vocab, n_vocab, special_texts(ll, vocab, n_vocab))

    def close(self) -> None:
        super().close()
        if self._model is not None:
            self._ll.llama_model_free(self._model)
            self._model = None
