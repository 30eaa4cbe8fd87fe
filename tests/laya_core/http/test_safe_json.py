"""safe_json.loads on bodies larger than the app tests' 4 KiB limit allows."""

from __future__ import annotations

import pytest

from laya_core.http import safe_json
from laya_core.http.errors import APIError


def refused(data: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        safe_json.loads(data)
    assert caught.value.status == 400
    return caught.value


def test_ten_thousand_levels_are_refused_as_too_deep() -> None:
    error = refused(b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    assert (error.param, error.code) == ("body", "too_deep")


def test_the_depth_bound_counts_the_body_itself() -> None:
    inner = safe_json.MAX_DEPTH - 1
    assert safe_json.loads(b'{"a": ' + b"[" * inner + b"]" * inner + b"}")
    assert refused(b'{"a": ' + b"[" * (inner + 1) + b"]" * (inner + 1) + b"}").param == "a"


def test_brackets_inside_strings_do_not_count() -> None:
    assert safe_json.loads(b'{"a": "' + b"[{" * 5000 + b'"}')


def test_integers_past_the_digit_limit_are_invalid_json() -> None:
    assert refused(b'{"max_tokens": ' + b"9" * 5000 + b"}").code == "invalid_json"


def test_paths_name_nested_fields() -> None:
    assert refused(b'{"a": [1, {"b": [NaN]}]}').param == "a[1].b[0]"
    assert refused(b'{"a": [1, 2, ' + b"1" * 20 + b"]}").param == "a[2]"
    assert refused(b'"\\ud800"').param == "body"


def test_surrogate_pairs_and_long_token_arrays_pass() -> None:
    assert safe_json.loads(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
    ids = list(range(100_000))
    assert safe_json.loads(str({"prompt": ids}).replace("'", '"').encode())["prompt"] == ids



ARGUMENTS = "messages[3].tool_calls[0].function.arguments"


def refused_field(text: str) -> APIError:
    with pytest.raises(APIError) as caught:
        safe_json.loads_field(text, ARGUMENTS)
    assert (caught.value.status, caught.value.param) == (400, ARGUMENTS)
    return caught.value


def test_json_inside_a_string_field_is_bounded_and_named() -> None:
    """A call's ``arguments`` or a schema sent as a string is JSON the body's check never
    saw: the same rules, with the field named."""
    assert refused_field("[" * 5000 + "]" * 5000).code == "too_deep"  # past json.loads' limit
    assert refused_field('{"a": ' + "[" * 64 + "]" * 64 + "}").code == "too_deep"
    assert safe_json.loads_field('{"a": ' + "[" * 63 + "]" * 63 + "}", ARGUMENTS)
    surrogate = refused_field('{"city": "\\ud800"}')
    assert surrogate.code == "invalid_string" and "(at city)" in surrogate.message
    assert refused_field('{"n": 1e400}').code == "invalid_value"
    assert refused_field("{").code == "invalid_json"
