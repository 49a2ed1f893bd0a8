"""Logprobs through the openai SDK: chat and completions shapes (streamed and not), values against transformers,
and lm-eval style loglikelihood (echo + logprobs on batched token-id prompts, max_tokens 0 or 1)."""

from __future__ import annotations

import math

import pytest

from tests.integration.api_helpers import MODEL, client, reference_log_softmax

pytestmark = pytest.mark.slow

ATOL = 1e-3


def test_chat_logprobs_unstreamed_match_transformers(cluster, hf):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = client(cluster).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    prompt = hf.chat_ids(messages)
    out_ids = hf.greedy_ids(prompt, 6)
    ref = reference_log_softmax(hf, prompt + out_ids)
    assert len(content) == r.usage.completion_tokens
    for i, entry in enumerate(content[:len(out_ids)]):
        assert entry.token == hf.tokenizer.decode([out_ids[i]])
        assert entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, ref[len(prompt) - 1 + i, out_ids[i]].item(), abs_tol=ATOL)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token          # greedy: the sampled token is the argmax
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_chat_logprobs_streamed(cluster):
    stream = client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], temperature=0, max_tokens=5,
        logprobs=True, top_logprobs=2, stream=True)
    entries, text = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            entries.extend(chunk.choices[0].logprobs.content)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert 1 <= len(entries) <= 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries).startswith(text[:3])


def test_completion_logprobs_shape_streamed_and_not(cluster):
    kwargs = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 4, "logprobs": 2}
    r = client(cluster).completions.create(**kwargs)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    streamed = [c for c in client(cluster).completions.create(**kwargs, stream=True) if c.choices]
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_prompt_logprobs_batched_token_ids_match_transformers(cluster, hf, max_tokens):
    """What lm-eval's local-completions loglikelihood sends: token-id prompts in a batch, echo, logprobs."""
    prompts = [hf.text_ids("The quick brown fox jumps over the lazy dog"),
               hf.text_ids("Paris is the capital of France. Berlin is the capital of Germany"),
               hf.text_ids("1, 2, 3, 4, 5, 6")]
    r = client(cluster).completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1,
                                           max_tokens=max_tokens, temperature=0)
    assert len(r.choices) == len(prompts)
    for choice in sorted(r.choices, key=lambda c: c.index):
        ids = prompts[choice.index]
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = reference_log_softmax(hf, ids)
        for j in range(1, len(ids)):
            assert math.isclose(lp.token_logprobs[j], ref[j - 1, ids[j]].item(), abs_tol=ATOL), j
            assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max().item(), abs=ATOL)
        assert choice.text.startswith(hf.tokenizer.decode(ids))
    assert r.usage.completion_tokens == max_tokens * len(prompts)


def test_echo_string_prompt_streamed(cluster):
    stream = client(cluster).completions.create(model=MODEL, prompt="Hello world", echo=True, max_tokens=2,
                                                temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text.startswith("Hello world") and len(text) > len("Hello world")
