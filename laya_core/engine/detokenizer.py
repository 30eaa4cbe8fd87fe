"""Incremental detokenization with stop strings.

Token pieces are bytes and may end inside a UTF-8 character, so bytes go through an incremental
decoder and a character is emitted only once it is whole. Text that could be the start of a
stop string is held back until it is known not to be one, so a client never sees part of a
stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    """``shown``: (id, text) of control tokens shown as their text (they give no bytes)."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...] = (),
                 shown: tuple[tuple[int, str], ...] = ()) -> None:
        self._token_bytes = token_bytes
        if shown:
            texts = {token: text.encode() for token, text in shown}
            self._token_bytes = lambda token: texts.get(token) or token_bytes(token)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet emitted: a possible stop-string prefix

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; return the text now safe to emit and whether a stop string matched.

        After a match, the returned text ends just before the stop string.
        """
        text = self._held + self._decoder.decode(self._token_bytes(token_id))
        if not self._stop:
            self._held = ""
            return text, False
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The rest of the text at the end of the sequence (held text and partial bytes)."""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
