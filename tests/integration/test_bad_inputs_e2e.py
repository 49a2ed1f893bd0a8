"""Every bad input we try, with the status it must get. All are 4xx in OpenAI's error shape; none kills or
stalls the engine: after the whole table, a normal request is served and every KV block is free.

This table is the documentation of what the API refuses (the README links here). Deliberately accepted, as
vLLM does: a request without `model` is served by the one model served."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_faults_e2e import assert_serves

pytestmark = pytest.mark.slow

M = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
RESP = "/v1/responses"
MSGS = "/v1/messages"
EMB = "/v1/embeddings"
HI = [{"role": "user", "content": "hi"}]

# (name, route, body (dict, or raw bytes), expected status)
BAD_INPUTS = [
    ("malformed JSON", CHAT, b'{"model": ', 400),
    ("body is a JSON array", CHAT, b"[1, 2, 3]", 400),
    ("body is a JSON string", COMP, b'"hello"', 400),
    ("invalid UTF-8 in the body", COMP, b'{"model": "' + M.encode() + b'", "prompt": "\xff\xfe"}', 400),
    ("missing messages", CHAT, {"model": M}, 400),
    ("missing prompt", COMP, {"model": M}, 400),
    ("empty messages", CHAT, {"model": M, "messages": []}, 400),
    ("message without content", CHAT, {"model": M, "messages": [{"role": "user"}]}, 400),
    ("unknown role", CHAT, {"model": M, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("messages not a list", CHAT, {"model": M, "messages": "hi"}, 400),
    ("unknown model", COMP, {"model": "gpt-17", "prompt": "hi"}, 404),
    ("temperature a string", CHAT, {"model": M, "messages": HI, "temperature": "hot"}, 400),
    ("temperature negative", CHAT, {"model": M, "messages": HI, "temperature": -0.5}, 400),
    ("temperature huge", CHAT, {"model": M, "messages": HI, "temperature": 1e308}, 400),
    ("top_p above 1", CHAT, {"model": M, "messages": HI, "top_p": 1.5}, 400),
    ("top_k a float", COMP, {"model": M, "prompt": "hi", "top_k": 2.5}, 400),
    ("max_tokens negative", COMP, {"model": M, "prompt": "hi", "max_tokens": -1}, 400),
    ("max_tokens a bool", COMP, {"model": M, "prompt": "hi", "max_tokens": True}, 400),
    ("max_tokens huge", COMP, {"model": M, "prompt": "hi", "max_tokens": 10 ** 30}, 400),
    ("n zero", COMP, {"model": M, "prompt": "hi", "n": 0}, 400),
    ("n above the cap", COMP, {"model": M, "prompt": "hi", "n": 10_000}, 400),
    ("seed a string", COMP, {"model": M, "prompt": "hi", "seed": "abc"}, 400),
    ("stop not strings", COMP, {"model": M, "prompt": "hi", "stop": [1, 2]}, 400),
    ("out-of-vocabulary token id", COMP, {"model": M, "prompt": [1, 2, 10 ** 6]}, 400),
    ("negative token id", COMP, {"model": M, "prompt": [1, -5]}, 400),
    ("empty prompt", COMP, {"model": M, "prompt": ""}, 400),
    ("empty token list", COMP, {"model": M, "prompt": []}, 400),
    ("prompt over the context", COMP, {"model": M, "prompt": "word " * 9000, "max_tokens": 4}, 400),
    ("prompt + max_tokens over the context", COMP, {"model": M, "prompt": "hi", "max_tokens": 9000}, 400),
    ("stream not a bool", CHAT, {"model": M, "messages": HI, "stream": "yes"}, 400),
    ("invalid JSON schema", CHAT, {"model": M, "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}}, 400),
    ("json_schema without a schema", CHAT, {"model": M, "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("unknown response_format type", CHAT, {"model": M, "messages": HI, "response_format": {"type": "xml"}}, 400),
    # /v1/embeddings on this (generate) model: refused in vLLM's words; bad bodies are refused before that.
    # The pooling model's own table is in test_embeddings_e2e.py.
    ("embeddings to a generate model", EMB, {"model": M, "input": "hi"}, 400),
    ("embeddings: empty input", EMB, {"model": M, "input": ""}, 400),
    ("embeddings: input a number", EMB, {"model": M, "input": 3.5}, 400),
    ("embeddings: unknown model", EMB, {"model": "text-embedding-17", "input": "hi"}, 404),
    ("tool_choice names a function not in tools", CHAT, {"model": M, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, 400),
    ("tool_choice without tools", CHAT, {"model": M, "messages": HI, "tool_choice": "required"}, 400),
    ("tool parameters not a JSON schema", CHAT, {"model": M, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, 400),
    ("tool message without tool_call_id", CHAT, {"model": M, "messages": [*HI, {"role": "tool", "content": "1"}]},
     400),
    ("deprecated functions", CHAT, {"model": M, "messages": HI, "functions": [{"name": "f"}]}, 400),
    ("responses: missing input", RESP, {"model": M}, 400),
    ("responses: input an empty list", RESP, {"model": M, "input": []}, 400),
    ("responses: unknown input item", RESP, {"model": M, "input": [{"type": "computer_call"}]}, 400),
    ("responses: image input", RESP, {"model": M, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400),
    ("responses: max_output_tokens zero", RESP, {"model": M, "input": "hi", "max_output_tokens": 0}, 400),
    ("responses: built-in tool", RESP, {"model": M, "input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("responses: json_schema without a schema", RESP, {"model": M, "input": "hi", "text": {
        "format": {"type": "json_schema", "name": "x"}}}, 400),
    ("responses: unknown previous_response_id", RESP, {"model": M, "input": "hi",
                                                       "previous_response_id": "resp_nope"}, 404),
    ("responses: prompt over the context", RESP, {"model": M, "input": "word " * 9000}, 400),
    ("responses: unknown model", RESP, {"model": "gpt-17", "input": "hi"}, 404),
]
# Anthropic's Messages API answers in its own shape: {"type": "error", "error": {"type", "message"}}.
MESSAGES_BAD_INPUTS = [
    ("messages: malformed JSON", MSGS, b'{"model": ', 400),
    ("messages: missing max_tokens", MSGS, {"model": M, "messages": HI}, 400),
    ("messages: max_tokens zero", MSGS, {"model": M, "messages": HI, "max_tokens": 0}, 400),
    ("messages: empty messages", MSGS, {"model": M, "messages": [], "max_tokens": 4}, 400),
    ("messages: system role in messages", MSGS, {"model": M, "messages": [{"role": "system", "content": "x"}],
                                                 "max_tokens": 4}, 400),
    ("messages: image block", MSGS, {"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400),
    ("messages: temperature above 1", MSGS, {"model": M, "messages": HI, "max_tokens": 4, "temperature": 1.5},
     400),
    ("messages: tool_choice names a tool not in tools", MSGS, {"model": M, "messages": HI, "max_tokens": 4,
     "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     400),
    ("messages: server tool", MSGS, {"model": M, "messages": HI, "max_tokens": 4,
                                     "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400),
    ("messages: prompt + max_tokens over the context", MSGS, {"model": M, "messages": HI, "max_tokens": 9000},
     400),
    ("messages: unknown model", MSGS, {"model": "claude-17", "messages": HI, "max_tokens": 4}, 404),
    ("count_tokens: missing messages", MSGS + "/count_tokens", {"model": M}, 400),
]
NAN_BODIES = [   # JSON with NaN / Infinity literals (Python's json accepts them; the API must not)
    ("NaN temperature", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                              b'"temperature": NaN}' % M.encode(), 400),
    ("Infinity top_p", COMP, b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % M.encode(), 400),
    # JSON can escape half a UTF-16 pair; such a string cannot be encoded (the tokenizer raised: a 500)
    ("lone surrogate in a prompt", COMP, b'{"model": "%s", "prompt": "hi \\ud83d there"}' % M.encode(), 400),
    ("lone surrogate in a message", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}'
     % M.encode(), 400),
]


@pytest.mark.parametrize("name,route,body,status", BAD_INPUTS + NAN_BODIES, ids=lambda x: x if isinstance(x, str)
                         and not x.startswith("/") else None)
def test_bad_input_gets_4xx_in_openai_shape(cluster, name, route, body, status):
    got, reply = cluster.post(route, body)
    assert got == status, (name, reply)
    err = reply["error"]
    assert {"message", "type", "param", "code"} <= set(err), (name, reply)
    assert err["message"] and "Traceback" not in json.dumps(reply), name


@pytest.mark.parametrize("name,route,body,status", MESSAGES_BAD_INPUTS, ids=lambda x: x if isinstance(x, str)
                         and not x.startswith("/") else None)
def test_bad_input_gets_4xx_in_anthropic_shape(cluster, name, route, body, status):
    got, reply = cluster.post(route, body)
    assert got == status, (name, reply)
    assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, (name, reply)
    assert reply["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), name
    assert reply["error"]["message"] and "Traceback" not in json.dumps(reply), name


def test_oversize_body_is_413(cluster):
    got, reply = cluster.post(COMP, {"model": M, "prompt": "x" * (5 * 1024 * 1024)})
    assert got == 413 and reply["error"]["message"]


def test_engine_still_serves_after_the_table(cluster):
    assert_serves(cluster)
