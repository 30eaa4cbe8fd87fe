"""A model's tokenizer as the HTTP side and the detokenizer use it, safe from any thread.

A backend hands one out (``Backend.tokenizer()``) once its weights are loaded. The HTTP side
tokenizes prompts on worker threads while the replica's engine thread runs steps, so a
tokenizer shares no per-step state with the backend. Where it calls into native code that the
backend frees at ``close()``, a :class:`UseGuard` keeps the two apart: calls run side by side,
and closing waits for those under way and refuses new ones.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterable, Iterator


class TokenizerClosedError(RuntimeError):
    """The model was unloaded; its replica has stopped."""


class Tokenizer(abc.ABC):
    """Text to token ids and token ids to bytes for one loaded model.

    Every method is safe to call from any thread, concurrently with the engine's steps and
    with other calls. A long ``encode`` should release the GIL (llama.cpp's does), so that
    other requests keep being served while a megabyte prompt is tokenized.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids are ``0 .. vocab_size - 1``."""

    @property
    @abc.abstractmethod
    def special_tokens(self) -> frozenset[str]:
        """Texts that ``encode(..., parse_special=True)`` turns into control tokens; message
        content holding them is encoded as text (laya_core/serving/chat_prompt.py)."""

    @abc.abstractmethod
    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Text to token ids. ``add_special``: the BOS (or similar) tokens the model adds
        to a whole prompt. ``parse_special``: markup of special tokens in ``text`` becomes
        those tokens; false, it stays text (how message content is encoded)."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token's text; may end in the middle of a UTF-8 character.
        Control tokens (``<|im_end|>``) give no bytes."""

    def decode(self, token_ids: Iterable[int]) -> str:
        """The text of ``token_ids``; bytes that are no UTF-8 become U+FFFD."""
        return b"".join(map(self.token_bytes, token_ids)).decode("utf-8", "replace")

    def first_unknown(self, token_ids: Iterable[int]) -> int | None:
        """The first id outside the vocabulary, or None when all are in it."""
        size = self.vocab_size
        return next((t for t in token_ids if not 0 <= t < size), None)


class UseGuard:
    """Lets any number of calls use a native handle at once; :meth:`close` waits for those
    under way, and a call after it raises :class:`TokenizerClosedError`."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._cond = threading.Condition()
        self._users = 0
        self._closed = False

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise TokenizerClosedError(f"{self._what} was unloaded")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    def close(self) -> None:
        """Refuse new calls and wait until none runs; then the handle may be freed."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._users)
