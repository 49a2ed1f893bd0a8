"""The request body parser: every malformed body is a 400 the client can read, never a 500 from the handler."""

from __future__ import annotations

import pytest

from steploop.gateway.errors import APIError
from steploop.gateway.http_io.request_body import MAX_JSON_DEPTH, parse_json_body


def refusal(raw: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    return caught.value


def test_nesting_past_the_interpreter_recursion_limit_is_a_400():
    # json.loads raises RecursionError (not a ValueError) for this: it was answered as a 500
    err = refusal(b"[" * 100_000 + b"]" * 100_000)
    assert f"more than {MAX_JSON_DEPTH} levels" in err.message


def test_nesting_just_past_the_limit_is_refused_and_at_the_limit_accepted():
    at_limit = b'{"a":' * (MAX_JSON_DEPTH - 1) + b"[]" + b"}" * (MAX_JSON_DEPTH - 1)
    body = parse_json_body(at_limit)
    assert isinstance(body, dict)
    past = b"[" + at_limit + b"]"
    assert "levels deep" in refusal(past).message


def test_an_integer_literal_over_pythons_digit_limit_is_a_400():
    # int('9' * 5000) raises a plain ValueError (not JSONDecodeError): it was answered as a 500
    err = refusal(b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert "not valid JSON" in err.message


@pytest.mark.parametrize("raw", [b"{bad", b"", b'{"a": "\xff"}'])
def test_plain_invalid_json_stays_a_400(raw):
    assert "not valid JSON" in refusal(raw).message


def test_lone_surrogate_is_still_refused_after_the_depth_check():
    with pytest.raises(APIError) as caught:
        parse_json_body(b'{"prompt": [["a\\ud800"]]}')
    assert caught.value.code == "invalid_unicode" and "prompt[0][0]" in caught.value.message
