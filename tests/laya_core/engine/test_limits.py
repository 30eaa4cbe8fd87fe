"""The length rule: prompt + max_tokens within max_seq_len."""

import pytest

from laya_core.engine.limits import RequestTooLongError, check_length, room_to_generate


def test_a_request_that_fills_max_seq_len_exactly_fits() -> None:
    check_length(60, 4, 64)
    assert room_to_generate(60, 64) == 4


def test_one_token_too_many_is_refused_with_the_total() -> None:
    with pytest.raises(RequestTooLongError, match="65 tokens in all.*max_seq_len of 64"):
        check_length(60, 5, 64)


def test_a_prompt_of_max_seq_len_leaves_no_room() -> None:
    assert room_to_generate(64, 64) == 0
    with pytest.raises(RequestTooLongError):
        check_length(64, 1, 64)
