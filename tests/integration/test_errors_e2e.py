"""Bad input gets a clear error in OpenAI's shape, never a stack trace, and the next request is served."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def assert_openai_error(status, body, expected_status, param=None, code=None):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, body
    if code is not None:
        assert err["code"] == code, body


BAD_BODIES = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_chat_requests_get_400_in_openai_shape(cluster, body, param):
    status, reply = cluster.post("/v1/chat/completions", body)
    assert_openai_error(status, reply, 400, param=param)
    ok, good = cluster.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert ok == 200 and good["choices"][0]["message"]["role"] == "assistant"


def test_unknown_model_is_404(cluster):
    status, reply = cluster.post("/v1/completions", {"model": "gpt-17", "prompt": "hi"})
    assert_openai_error(status, reply, 404, code="model_not_found")


def test_context_length_exceeded_names_both_numbers(cluster):
    status, reply = cluster.post("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 10})
    assert_openai_error(status, reply, 400, code="context_length_exceeded")
    assert "8192" in reply["error"]["message"]


def test_sdk_raises_bad_request_and_recovers(cluster):
    c = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=9)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).choices[0].text
