"""The tokenizer contract's helpers: decoding, vocabulary checks, and the lifetime guard."""

from __future__ import annotations

import threading
import time

import pytest
from toy_backend import END, ToyTokenizer

from laya_core.models.tokenizer import TokenizerClosedError, UseGuard


def test_decode_joins_bytes_split_across_tokens() -> None:
    tok = ToyTokenizer()
    ids = tok.encode("wörld", add_special=True)
    assert len(ids) == 6  # "ö" is two tokens
    assert tok.decode(ids + [END]) == "wörld"
    assert tok.decode(ids[:2]) == "w\ufffd"  # half a character


def test_first_unknown_names_the_first_id_outside_the_vocabulary() -> None:
    tok = ToyTokenizer()
    assert tok.first_unknown([0, 256, 257, -1]) == 257
    assert tok.first_unknown([-1]) == -1
    assert tok.first_unknown([]) is None


def test_close_waits_for_calls_under_way_and_refuses_new_ones() -> None:
    guard = UseGuard("the vocabulary")
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()

    def user() -> None:
        with guard.use():
            inside.set()
            release.wait(5)

    def closer() -> None:
        guard.close()
        closed.set()

    users = [threading.Thread(target=user) for _ in range(2)]
    for t in users:
        t.start()
    assert inside.wait(5)
    closing = threading.Thread(target=closer)
    closing.start()
    time.sleep(0.05)
    assert not closed.is_set()  # two calls still use the handle
    with pytest.raises(TokenizerClosedError, match="the vocabulary was unloaded"):
        with guard.use():
            pass
    release.set()
    assert closed.wait(5)
    for t in [*users, closing]:
        t.join(5)
