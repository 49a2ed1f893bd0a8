"""A message without a role says the role is missing (not "got None"); a wrong one names what it got."""

from __future__ import annotations

import pytest

from steploop.gateway.errors import APIError
from steploop.gateway.openai_api.protocol import parse_chat_messages
from steploop.gateway.responses_api.protocol import parse_input


def test_chat_message_without_role_says_missing():
    with pytest.raises(APIError) as exc:
        parse_chat_messages({"messages": [{"role": "user", "content": "hi"}, {"content": "no role"}]})
    err = exc.value.body()["error"]
    assert err["message"].startswith("messages[1].role is missing;"), err
    assert "None" not in err["message"] and err["param"] == "messages"
    assert err["code"] == "missing_required_parameter"


def test_chat_message_with_unknown_role_names_it():
    with pytest.raises(APIError) as exc:
        parse_chat_messages({"messages": [{"role": "robot", "content": "hi"}]})
    err = exc.value.body()["error"]
    assert err["message"].startswith("messages[0].role is 'robot'; it must be one of"), err
    assert err["code"] == "invalid_value"


def test_responses_input_message_without_role_says_missing():
    with pytest.raises(APIError) as exc:
        parse_input([{"type": "message", "content": "hi"}])
    err = exc.value.body()["error"]
    assert err["message"].startswith("input[0].role is missing;"), err
    assert err["param"] == "input" and err["code"] == "missing_required_parameter"
