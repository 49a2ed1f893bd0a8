"""vLLM's extra fields (services/gateway/openai_api/vllm_extras.py): the ones steploop does not build are a 400
naming them (never dropped silently) unless they hold their "off" value; vLLM's spellings of structured output reach
the engine as the same constraint response_format gives; two spellings at once are a 400."""

from __future__ import annotations

import json

import pytest

from steploop.gateway.app_keys import SERVING
from steploop.gateway.openai_api.vllm_extras import NOT_BUILT
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

COMPLETION = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SET = {"logits_processors": ["x"],
       "return_tokens_as_token_ids": True, "spaces_between_special_tokens": False, "mm_processor_kwargs": {"a": 1},
       "chat_template": "{{ messages }}", "documents": [{"text": "d"}]}


def test_every_field_not_built_has_a_case():
    assert set(SET) == set(NOT_BUILT)


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
                                        ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("name", sorted(SET))
async def test_a_field_not_built_is_refused_by_name(gateway, path, base, name):
    status, resp, _ = await post(gateway, path, {**base, name: SET[name]})
    assert status == 400, resp
    assert_error(resp, param=name, code="unsupported_parameter")
    assert gateway.engine.requests == []


async def test_their_off_values_are_accepted(gateway):
    off = {"allowed_token_ids": None, "bad_words": [], "use_beam_search": False, "logits_processors": [],
           "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True, "prompt_logprobs": None,
           "mm_processor_kwargs": {}}
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, **off}))[0] == 200
    assert (await post(gateway, "/v1/completions", {**COMPLETION, **off}))[0] == 200


async def test_chat_echo_puts_the_last_assistant_message_in_front(gateway, reply):
    # vLLM's chat echo: the reply starts with the assistant turn it continues, whole and streamed, every choice
    reply("lo there")
    body = {**CHAT, "max_tokens": 8, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Hel"}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True, "n": 2}
    status, resp, _ = await post(gateway, "/v1/chat/completions", body)
    assert status == 200, resp
    assert [c["message"]["content"] for c in resp["choices"]] == ["Hello there"] * 2
    streamed = {0: "", 1: ""}
    extra = {k: body.pop(k) for k in ("continue_final_message", "add_generation_prompt", "echo")}
    async for chunk in await gateway.openai().chat.completions.create(**body, stream=True, extra_body=extra):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: "Hello there", 1: "Hello there"}
    body.update(extra)
    # after a user turn there is nothing to echo; off values and a wrong type behave as every bool field
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "echo": True})
    assert status == 200 and resp["choices"][0]["message"]["content"] == "lo there"
    for off in (False, None):
        assert (await post(gateway, "/v1/chat/completions", {**body, "echo": off}))[0] == 200
    assert (await post(gateway, "/v1/chat/completions", {**body, "echo": "yes"}))[0] == 400


@pytest.mark.parametrize("extra, schema, json_object", [
    ({"guided_json": SCHEMA}, SCHEMA, False),
    ({"guided_json": json.dumps(SCHEMA)}, SCHEMA, False),                      # vLLM also takes the JSON text
    ({"structured_outputs": {"json": SCHEMA}}, SCHEMA, False),
    ({"structured_outputs": {"json_object": True}}, None, True),
])
async def test_vllm_structured_output_reaches_the_engine(gateway, extra, schema, json_object):
    for path, base in (("/v1/chat/completions", {**CHAT, "max_tokens": 2}), ("/v1/completions", COMPLETION)):
        assert (await post(gateway, path, {**base, **extra}))[0] == 200
    for sent in gateway.engine.requests:
        assert (json.loads(sent.sampling.json_schema) if sent.sampling.json_schema else None) == schema
        assert sent.sampling.json_object == json_object


@pytest.mark.parametrize("extra", [{"guided_regex": "[a-z]+"}, {"structured_outputs": {"regex": "[a-z]+"}}])
async def test_a_user_regex_reaches_the_engine(gateway, extra):
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, **extra}))[0] == 200
    assert [sent.sampling.regex for sent in gateway.engine.requests] == ["[a-z]+"]


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": "a\u0000b"}, "guided_regex"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["a\u0000b"]}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_json": SCHEMA}, "guided_choice"),
    ({"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs"),
])
async def test_conflicting_or_bad_constraints_are_400(gateway, extra, param):
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, **extra})
    assert status == 400, resp
    assert_error(resp, param=param)
    assert gateway.engine.requests == []


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                     "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")


async def test_chat_template_kwargs_reach_the_template(gateway, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "chat_template", THINKING_TEMPLATE)   # a template with a switch (Qwen3's)
    messages = [{"role": "user", "content": "hi"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    want = tokenizer.encode_sync("hi /no_think", add_special_tokens=False)
    assert (await post(gateway, "/tokenize", {"messages": messages, **off}))[1]["tokens"] == want
    assert (await post(gateway, "/tokenize", {"messages": messages}))[1]["tokens"] == \
        tokenizer.encode_sync("hi", add_special_tokens=False)
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, **off}))[0] == 200
    assert list(gateway.engine.requests[-1].prompt_token_ids) == want


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"add_generation_prompt": False}, {"chat_template": "x"},
                                    {"self": 1}, 5])
async def test_chat_template_kwargs_cannot_override_the_request(gateway, kwargs):
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs})
    assert status == 400, resp
    assert_error(resp, param="chat_template_kwargs")
    assert gateway.engine.requests == []


async def test_truncate_prompt_tokens_keeps_the_last_tokens(gateway, tokenizer):
    ids = tokenizer.encode_sync("one two three four five six", add_special_tokens=False)
    status, body, _ = await post(gateway, "/v1/completions", {**COMPLETION, "prompt": ids, "echo": True,
                                                              "truncate_prompt_tokens": 3})
    assert status == 200 and list(gateway.engine.requests[-1].prompt_token_ids) == ids[-3:]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"].startswith(tokenizer.decode(ids[-3:]))    # echo: what the model saw
    short = {**COMPLETION, "prompt": ids[:2], "truncate_prompt_tokens": 3}       # already short: unchanged
    assert (await post(gateway, "/v1/completions", short))[0] == 200
    assert list(gateway.engine.requests[-1].prompt_token_ids) == ids[:2]
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "truncate_prompt_tokens": 4}))[0] == 200
    assert len(gateway.engine.requests[-1].prompt_token_ids) == 4
    for bad in (0, -2, "3"):
        status, resp, _ = await post(gateway, "/v1/completions", {**COMPLETION, "truncate_prompt_tokens": bad})
        assert status == 400 and resp["error"]["param"] == "truncate_prompt_tokens"


async def test_truncate_prompt_tokens_minus_one_is_the_context_length(gateway, tokenizer):
    gateway.engine.max_model_len = 5
    gateway.app[SERVING].model.max_model_len = 5         # the gateway learnt the context length at start
    ids = tokenizer.encode_sync("one two three four five six", add_special_tokens=False)
    await post(gateway, "/v1/completions", {**COMPLETION, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert list(gateway.engine.requests[-1].prompt_token_ids) == ids[-5:]


@pytest.mark.parametrize("extra", [{"guided_choice": ["yes", "a.b (c)|d*", "x\\y"]},
                                   {"structured_outputs": {"choice": ["yes", "a.b (c)|d*", "x\\y"]}}])
async def test_a_choice_reaches_the_engine_as_a_regex_of_its_literals(gateway, extra):
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, **extra}))[0] == 200
    sent = gateway.engine.requests[-1].sampling
    assert sent.regex == r"(yes|a\.b \(c\)\|d\*|x\\y)" and not sent.json_schema and not sent.json_object


async def test_a_value_the_template_cannot_use_is_a_400(gateway, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "chat_template", "{{ messages[0]['content'] }}{{ depth + 1 }}")
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"depth": "x"}})
    assert status == 400, resp
    assert_error(resp, param="messages")
