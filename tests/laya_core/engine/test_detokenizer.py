from laya_core.engine.detokenizer import IncrementalDetokenizer


def run(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    detok = IncrementalDetokenizer(lambda t: bytes([t]), stop)
    pieces = []
    for byte in text.encode():
        piece, stopped = detok.add(byte)
        pieces.append(piece)
        if stopped:
            return pieces, True, ""
    return pieces, False, detok.flush()


def test_multibyte_characters_are_never_split() -> None:
    pieces, _, rest = run("héllo, 世界 🎉")
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == "héllo, 世界 🎉"
    assert pieces[1] == "" and pieces[2] == "é"  # é is two bytes: nothing until it is whole


def test_stop_string_cuts_and_is_never_emitted() -> None:
    pieces, stopped, _ = run("one two STOP three", ("STOP",))
    assert stopped and "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_held_prefix_is_released_when_it_does_not_match() -> None:
    pieces, stopped, rest = run("a ST b", ("STOP",))
    assert not stopped
    assert "".join(pieces) + rest == "a ST b"


def test_earliest_of_several_stops_wins() -> None:
    pieces, stopped, _ = run("xx<end>yy", ("yy", "<end>"))
    assert stopped and "".join(pieces) == "xx"
