"""vLLM's prompt_logprobs on /v1/completions (per choice) and /v1/chat/completions (top level): one entry per
prompt token, null first, each a dict keyed by token id with logprob, rank and decoded_token for the token itself
and the top k; with echo + logprobs the engine computes the larger k once. Streaming and out-of-range k are 400s."""

from __future__ import annotations

import dataclasses

import pytest

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

COMPLETION = {"model": SERVED_NAME, "prompt": "The capital of France", "max_tokens": 2}


def check_shape(entries, prompt_ids, k, namer):
    """The fake engine scripts each prompt token at -0.25, rank 3, and the top k as ids 0..k-1 at -1, -2, ..."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        assert token >= k                                     # (real text: never the ids 0..k-1)
        assert set(entry) == {str(token), *(str(t) for t in range(k))}
        assert entry[str(token)] == {"logprob": -0.25, "rank": 3, "decoded_token": namer(token)}
        for t in range(k):
            assert entry[str(t)] == {"logprob": -1.0 - t, "rank": t + 1, "decoded_token": namer(t)}


async def test_completions_per_choice(gateway, tokenizer):
    ids = tokenizer.encode_sync(COMPLETION["prompt"])
    status, body, _ = await post(gateway, "/v1/completions", {**COMPLETION, "prompt_logprobs": 2, "n": 2})
    assert status == 200, body
    assert gateway.engine.requests[0].sampling.prompt_logprobs == 2
    for choice in body["choices"]:
        check_shape(choice["prompt_logprobs"], ids, 2, lambda t: tokenizer.decode([t], skip_special_tokens=False))
        assert choice["logprobs"] is None


async def test_chat_top_level(gateway, tokenizer):
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == prompt_tokens and body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] == 3 for e in body["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in body["choices"][0]


async def test_not_asked_not_shown(gateway):
    status, body, _ = await post(gateway, "/v1/completions", COMPLETION)
    assert status == 200 and "prompt_logprobs" not in body["choices"][0]
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert status == 200 and "prompt_logprobs" not in body


async def test_echo_logprobs_and_prompt_logprobs_share_one_run(gateway, tokenizer):
    ids = tokenizer.encode_sync(COMPLETION["prompt"])
    status, body, _ = await post(gateway, "/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "echo": True,
                                                             "logprobs": 3})
    assert status == 200, body
    assert gateway.engine.requests[0].sampling.prompt_logprobs == 3
    choice = body["choices"][0]
    assert all(len(entry) <= 2 for entry in choice["prompt_logprobs"][1:])   # its own k (1), not echo's 3
    assert len(choice["logprobs"]["top_logprobs"][1]) == 4                   # echo's 3 plus the token itself
    assert len(choice["prompt_logprobs"]) == len(ids)


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1},
                                   {"prompt_logprobs": 21}, {"prompt_logprobs": "2"}, {"prompt_logprobs": True}])
async def test_refused(gateway, path, base, extra):
    status, body, _ = await post(gateway, path, {**base, **extra})
    assert status == 400, body
    assert_error(body, param="prompt_logprobs")
    assert gateway.engine.requests == []


class TestBehindAReasoningParser:
    """The reasoning splitter passes only events with text: the prompt logprobs ride on one, never alone."""

    @pytest.fixture
    def gateway_config(self, gateway_config):
        return dataclasses.replace(gateway_config, reasoning_parser="qwen3")

    async def test_chat_keeps_them(self, gateway):
        status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "prompt_logprobs": 1})
        assert status == 200, body
        assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
