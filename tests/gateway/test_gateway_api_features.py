"""Gateway-side features against the fake engine: logprobs shapes, echo, max_tokens 0, n seeds, logit_bias and
response_format plumbing, /tokenize, /detokenize, /openapi.json."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from tests.gateway.conftest import SERVED_NAME


async def test_chat_logprobs_shape(gateway, tokenizer):
    r = await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2, max_tokens=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(e.logprob == -0.5 and len(e.top_logprobs) == 2 for e in content)
    assert content[0].token == tokenizer.decode([gateway.engine.reply_ids[0]], skip_special_tokens=False)
    assert content[0].bytes == list(content[0].token.encode())
    assert gateway.engine.requests[0].sampling.logprobs == 2


async def test_completion_echo_logprobs_and_max_tokens_zero(gateway, tokenizer):
    prompt = [[1, 2, 3], [4, 5]]
    r = await gateway.openai().completions.create(model=SERVED_NAME, prompt=prompt, echo=True, logprobs=1,
                                                  max_tokens=0)
    for choice in r.choices:
        ids = prompt[choice.index]
        lp = choice.logprobs
        assert lp.token_logprobs == [None] + [-0.25] * (len(ids) - 1) and lp.top_logprobs[0] is None
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        assert lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 0
    sent = gateway.engine.requests[0].sampling
    assert sent.max_tokens == 1 and sent.prompt_logprobs == 1


async def test_completion_streamed_logprobs_offsets(gateway):
    stream = await gateway.openai().completions.create(model=SERVED_NAME, prompt="Hi", logprobs=0, max_tokens=4,
                                                       stream=True)
    chunks = [c async for c in stream]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert offsets[0] == 0 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


async def test_n_seeded_choices_get_distinct_seeds_and_params_reach_engine(gateway):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], n=3, seed=10, max_tokens=2,
        logit_bias={"7": 5, "3": -100}, response_format=fmt)
    sent = sorted(gateway.engine.requests, key=lambda r: r.request_id)
    assert [r.sampling.seed for r in sent] == [10, 11, 12]
    assert dict(sent[0].sampling.logit_bias) == {7: 5.0, 3: -100.0}
    assert json.loads(sent[0].sampling.json_schema) == {"type": "object"}


async def test_tokenize_detokenize_openapi(gateway, tokenizer):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/tokenize", json={"prompt": "Hello world"}) as resp:
            body = await resp.json()
            assert body["tokens"] == tokenizer.encode_sync("Hello world") and body["count"] == len(body["tokens"])
        async with http.post(f"{gateway.url}/detokenize", json={"tokens": body["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == "Hello world"
        async with http.post(f"{gateway.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
                             ) as resp:
            strs = (await resp.json())["token_strs"]
            assert strs == tokenizer.hf.convert_ids_to_tokens(body["tokens"]) and "".join(strs) == "HelloĠworld"
        async with http.post(f"{gateway.url}/tokenize", json={}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
        async with http.get(f"{gateway.url}/openapi.json") as resp:
            spec = await resp.json()
            assert spec["openapi"].startswith("3.1") and "/v1/chat/completions" in spec["paths"]


@pytest.mark.parametrize("extra, kind", [
    ({"response_format": {"type": "json_object"}}, "response_format json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice required"),
])
async def test_structured_output_cut_by_max_tokens_is_logged_with_the_hint(gateway, caplog, extra, kind):
    caplog.set_level(logging.WARNING, logger="steploop.gateway")
    r = await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **extra)
    assert r.choices[0].finish_reason == "length"
    [line] = [rec.getMessage() for rec in caplog.records if "finished by length" in rec.getMessage()]
    assert f"structured output ({kind}) finished by length after 3 tokens" in line
    assert "ran out of max_tokens inside the grammar" in line and "raise max_tokens" in line
    caplog.clear()
    r = await gateway.openai().chat.completions.create(     # plain text cut by max_tokens is not worth a line
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert not [rec for rec in caplog.records if "finished by length" in rec.getMessage()]
