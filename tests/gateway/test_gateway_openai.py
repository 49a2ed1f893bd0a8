"""The OpenAI API through the official SDK, against the fake engine: shapes, streaming, usage, n, batches."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.gateway.conftest import REPLY_TEXT, SERVED_NAME, wait_for


async def test_chat_unstreamed(gateway, tokenizer):
    client = gateway.openai()
    r = await client.chat.completions.create(model=SERVED_NAME, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.created > 0
    assert r.model == SERVED_NAME
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == REPLY_TEXT
    assert r.choices[0].finish_reason == "stop"
    sent = gateway.engine.requests[0]
    expected_prompt = tokenizer.chat_sync([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi!"}])
    assert list(sent.prompt_token_ids) == expected_prompt
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == len(gateway.engine.reply_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # max_tokens unset: sent unset, the engine gives it whatever fits in the context
    assert not sent.sampling.HasField("max_tokens")


async def test_chat_streamed_with_usage(gateway):
    client = gateway.openai()
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        stream=True, stream_options={"include_usage": True}, max_completion_tokens=100)
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == REPLY_TEXT and "\ufffd" not in content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(gateway.engine.reply_ids)
    assert gateway.engine.requests[0].sampling.max_tokens == 100


async def test_completion_unstreamed_and_length(gateway, tokenizer):
    client = gateway.openai()
    r = await client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=3,
                                        temperature=0.5, top_p=0.9, seed=7,
                                        extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 1})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tokenizer.decode(gateway.engine.reply_ids[:3])
    s = gateway.engine.requests[0].sampling
    assert (s.max_tokens, s.top_k, s.seed, s.min_tokens) == (3, 20, 7, 1)
    assert abs(s.temperature - 0.5) < 1e-6 and abs(s.top_p - 0.9) < 1e-6 and abs(s.min_p - 0.05) < 1e-6
    assert r.usage.completion_tokens == 3


async def test_completion_streamed(gateway):
    client = gateway.openai()
    stream = await client.completions.create(model=SERVED_NAME, prompt="Say hi", stream=True, max_tokens=200)
    chunks = [c async for c in stream]
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_completion_token_ids_and_batch_prompts(gateway):
    client = gateway.openai()
    r = await client.completions.create(model=SERVED_NAME, prompt=["first", "second", "third"], max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    r2 = await client.completions.create(model=SERVED_NAME, prompt=[5, 6, 7], max_tokens=5)
    assert list(gateway.engine.requests[-1].prompt_token_ids) == [5, 6, 7]
    assert r2.usage.prompt_tokens == 3


async def test_n_fans_out(gateway):
    client = gateway.openai()
    r = await client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}], n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == REPLY_TEXT for c in r.choices)
    assert len({q.request_id for q in gateway.engine.requests}) == 3
    # the prompt is counted once, completions for every choice
    assert r.usage.prompt_tokens == len(gateway.engine.requests[0].prompt_token_ids)
    assert r.usage.completion_tokens == 3 * len(gateway.engine.reply_ids)


async def test_stop_string_across_tokens_cancels_engine_call(gateway, tokenizer):
    gateway.engine.token_delay_s = 0.02   # the engine is still generating when the stop string matches
    client = gateway.openai()
    r = await client.completions.create(model=SERVED_NAME, prompt="x", stop=["o th"], max_tokens=50)
    assert r.choices[0].text == "Hell" and r.choices[0].finish_reason == "stop"
    r = await client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                             stop=["世界"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "Hello there! 你好，世界"
    # leaving the stream early cancels the engine call (the scheduler aborts the request)
    await wait_for(lambda: len(gateway.engine.cancelled) == 2)
    assert gateway.engine.finished == []


async def test_stop_string_finish_reports_cached_tokens(gateway):
    """A choice cut by a stop string stops reading the engine before its last chunk: its cached tokens come from
    the usage on the first chunk with tokens (a prefix hit), in every API's usage."""
    gateway.engine.cached_tokens = 4
    gateway.engine.token_delay_s = 0.02   # still generating when the stop string matches
    client = gateway.openai()
    r = await client.completions.create(model=SERVED_NAME, prompt="x", stop=["o th"], max_tokens=50)
    assert r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens_details.cached_tokens == 4
    stream = await client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                                  stop=["世界"], stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert gateway.engine.finished == []   # cut before the engine's last chunk


async def test_stop_string_streamed_never_leaks_stop_text(gateway):
    client = gateway.openai()
    stream = await client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                                  stop=["The end"], stream=True)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there! 你好，世界 🎉🚀 "
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_models_health_version(gateway):
    models = await gateway.openai().models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    card = await gateway.openai().models.retrieve(SERVED_NAME)     # GET /v1/models/{id}
    assert card.id == SERVED_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await gateway.openai().models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway.url}/v1/models") as resp:
            assert (await resp.json())["data"][0]["max_model_len"] == 2048
        async with http.get(f"{gateway.url}/health") as resp:
            assert resp.status == 200
        async with http.get(f"{gateway.url}/version") as resp:
            assert "version" in await resp.json()


async def test_text_cut_inside_a_character_is_decode_of_the_tokens(gateway, tokenizer, reply_ids):
    """max_tokens ends the reply between the byte-level tokens of one emoji: streamed or not, the text is what
    decode() gives for the tokens generated (U+FFFD for the half character), not the text with them dropped."""
    cut = next(n for n in range(1, len(reply_ids)) if tokenizer.decode(reply_ids[:n]).endswith("\ufffd"))
    expected = tokenizer.decode(reply_ids[:cut])
    client = gateway.openai()
    whole = await client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=cut)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    stream = await client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=cut, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == expected


async def test_completions_default_to_16_tokens_as_openai_and_vllm(gateway):
    """The legacy completions API's max_tokens defaults to 16 (chat's to what fits, test_chat_unstreamed)."""
    await gateway.openai().completions.create(model=SERVED_NAME, prompt="Once upon a time")
    assert gateway.engine.requests[-1].sampling.max_tokens == 16


async def test_the_stop_token_is_counted_but_not_shown(gateway, tokenizer, reply_ids):
    """As vLLM: the token that stopped the request (EOS here; stop_token_ids alike) is in usage but not in the text,
    even with skip_special_tokens off, unless include_stop_str_in_output asks for it."""
    client = gateway.openai()
    eos_text = tokenizer.decode([reply_ids[-1]], skip_special_tokens=False)
    for stream in (False, True):
        for include in (False, True):
            extra = {"skip_special_tokens": False, "include_stop_str_in_output": include}
            r = await client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=64, stream=stream,
                                                extra_body=extra)
            text = "".join([c.choices[0].text async for c in r if c.choices]) if stream else r.choices[0].text
            assert text == REPLY_TEXT + (eos_text if include else "")
    r = await client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=64)
    assert r.usage.completion_tokens == len(reply_ids) and r.choices[0].finish_reason == "stop"
