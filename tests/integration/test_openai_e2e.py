"""The official openai SDK against the real cluster: greedy text equals transformers' greedy generation."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count from one to five."}],
]
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
]


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def aclient(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_unstreamed_equals_transformers(cluster, hf, messages):
    resp = client(cluster).chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS)
    prompt_ids = hf.chat_ids(messages)
    assert resp.choices[0].message.content == hf.greedy_text(prompt_ids, MAX_TOKENS)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(hf.greedy_ids(prompt_ids, MAX_TOKENS)) + \
        (resp.choices[0].finish_reason == "stop")
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("messages", CHATS[:2])
def test_chat_streamed_equals_transformers(cluster, hf, messages):
    stream = client(cluster).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hf.greedy_text(hf.chat_ids(messages), MAX_TOKENS)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(hf.chat_ids(messages))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_unstreamed_equals_transformers(cluster, hf, prompt):
    resp = client(cluster).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert resp.choices[0].text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completion_streamed_equals_transformers(cluster, hf, prompt):
    stream = client(cluster).completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS)


async def _sixteen_at_once(cluster, hf, streamed: bool, model: str = MODEL):
    """16 requests at once (chats and completions, streamed or not); each text must be transformers' greedy one
    (tests/tp runs it against tensor-parallel groups, with their model's name)."""
    c = aclient(cluster)
    jobs = []
    for i in range(16):
        if i % 2:
            jobs.append(("chat", CHATS[i // 2 % 4]))
        else:
            jobs.append(("text", PROMPTS[i // 2 % 4]))

    async def one(kind, item):
        if kind == "chat":
            if streamed:
                s = await c.chat.completions.create(model=model, messages=item, temperature=0,
                                                    max_tokens=MAX_TOKENS, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
            r = await c.chat.completions.create(model=model, messages=item, temperature=0, max_tokens=MAX_TOKENS)
            return r.choices[0].message.content
        if streamed:
            s = await c.completions.create(model=model, prompt=item, temperature=0, max_tokens=MAX_TOKENS,
                                           stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])
        r = await c.completions.create(model=model, prompt=item, temperature=0, max_tokens=MAX_TOKENS)
        return r.choices[0].text

    texts = await asyncio.gather(*(one(k, item) for k, item in jobs))
    await c.close()
    for (kind, item), text in zip(jobs, texts):
        ids = hf.chat_ids(item) if kind == "chat" else hf.text_ids(item)
        assert text == hf.greedy_text(ids, MAX_TOKENS), (kind, item)


@pytest.mark.parametrize("streamed", [False, True])
def test_sixteen_concurrent_equal_transformers(cluster, hf, streamed):
    asyncio.run(_sixteen_at_once(cluster, hf, streamed))


def test_small_budget_gives_same_tokens(small_budget_cluster, hf):
    """--max-num-batched-tokens 16 chunks every prompt; the tokens must not change (vs 2048 above)."""
    asyncio.run(_sixteen_at_once(small_budget_cluster, hf, streamed=True))


def test_models_and_health(cluster):
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert cluster.health() == 200
