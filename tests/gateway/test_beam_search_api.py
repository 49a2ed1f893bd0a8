"""use_beam_search on /v1/completions and /v1/chat/completions against a fake engine whose logprobs come from a
tiny deterministic "model" (a seeded distribution per sequence over 24 tokens and EOS): each prompt is one engine
request carrying the beam width (the engine runs the search, here over that model with the one ranking), the n
choices are the search's n best beams in order with their text, finish reason, usage and logprobs; streaming gives
the same beams; fields beam search cannot honour are 400s naming them. The ranking itself is checked against
transformers in test_beam_search_hf.py, the scheduler's search in tests/scheduler/test_beam_groups.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from steploop.common.beam_ranking import BeamConfig, BeamRanking
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

PROMPT = "The capital of France"


@pytest.fixture
def toy(fake_engine, tokenizer):
    words = tokenizer.encode_sync(" a b c d e f g h i j k l m n o p q r s t u v w x", add_special_tokens=False)
    vocab = np.array(sorted(set(words))[:24] + [tokenizer.eos_token_id])

    def top(seq):
        rng = np.random.default_rng(zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes()))
        logits = rng.normal(0.0, 2.5, len(vocab))
        logp = logits - np.log(np.exp(logits).sum())
        order = np.argsort(-logp)
        return [int(t) for t in vocab[order]], [float(x) for x in logp[order]]

    fake_engine.top_fn = top
    return top


async def expected(top, prompt, width, max_tokens, eos, penalty=1.0, early=False):
    ranking = BeamRanking(BeamConfig(width, penalty, early), max_tokens, frozenset({eos}))
    while not ranking.done:
        ranking.step([list(zip(*top(prompt + b.tokens)))[:ranking.k] for b in ranking.running])
    return ranking.finished


async def test_completions_returns_the_n_best_beams(gateway, tokenizer, toy):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 6, "use_beam_search": True, "n": 2, "best_of": 3,
            "logprobs": 2, "length_penalty": 0.5}
    status, reply, _ = await post(gateway, "/v1/completions", body)
    assert status == 200, reply
    prompt = tokenizer.encode_sync(PROMPT)
    want = (await expected(toy, prompt, 3, 6, tokenizer.eos_token_id, penalty=0.5))[:2]
    requests = gateway.engine.requests
    assert len(requests) == 1 and requests[0].prompt_token_ids == prompt     # the search runs in the engine
    assert requests[0].beam_search.width == 3 and requests[0].beam_search.length_penalty == 0.5
    assert requests[0].sampling.max_tokens == 6 and requests[0].sampling.logprobs == 2
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice, hyp in zip(reply["choices"], want):
        ids = hyp.tokens[:-1] if hyp.finish_reason == "stop" else hyp.tokens
        assert choice["text"] == tokenizer.decode(ids)
        assert choice["finish_reason"] == hyp.finish_reason
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(hyp.tokens) and sum(lps) == pytest.approx(hyp.cum_logprob, abs=1e-4)
        assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert reply["usage"]["completion_tokens"] == sum(len(h.tokens) for h in want)
    assert reply["usage"]["prompt_tokens"] == len(prompt)


async def test_two_prompts_each_searched(gateway, tokenizer, toy):
    body = {"model": SERVED_NAME, "prompt": [PROMPT, "Hello there"], "max_tokens": 4, "use_beam_search": True,
            "n": 2}
    status, reply, _ = await post(gateway, "/v1/completions", body)
    assert status == 200, reply
    for p, text in enumerate([PROMPT, "Hello there"]):
        want = await expected(toy, tokenizer.encode_sync(text), 2, 4, tokenizer.eos_token_id)
        got = [c for c in reply["choices"] if c["index"] // 2 == p]
        assert [c["text"] for c in sorted(got, key=lambda c: c["index"])] == \
               [tokenizer.decode(h.tokens[:-1] if h.finish_reason == "stop" else h.tokens) for h in want]


async def test_chat_streamed_equals_unstreamed(gateway, toy):
    body = {**CHAT, "max_tokens": 5, "use_beam_search": True, "n": 2, "early_stopping": True}
    status, whole, _ = await post(gateway, "/v1/chat/completions", body)
    assert status == 200, whole
    client = gateway.openai()
    stream = await client.chat.completions.create(model=SERVED_NAME, messages=CHAT["messages"], max_tokens=5, n=2,
                                                  stream=True, extra_body={"use_beam_search": True,
                                                                           "early_stopping": True})
    texts, finishes = {0: "", 1: ""}, {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["x"]}, "stop"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"echo": True}, "echo"),
    ({"n": 3, "best_of": 2}, "n"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"best_of": 99}, "best_of"),
    ({"length_penalty": "long"}, "length_penalty"),
])
async def test_what_beams_cannot_honour_is_a_400(gateway, extra, param):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3, "use_beam_search": True, **extra}
    status, reply, _ = await post(gateway, "/v1/completions", body)
    assert status == 400, reply
    assert_error(reply, param=param)
    assert gateway.engine.requests == []


async def test_best_of_without_beam_search_is_refused(gateway):
    status, reply, _ = await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": PROMPT, "best_of": 2})
    assert status == 400
    assert_error(reply, param="best_of")


async def test_beam_search_off_is_sampling(gateway):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3, "use_beam_search": False, "length_penalty": 2}
    status, _, _ = await post(gateway, "/v1/completions", body)
    assert status == 200 and len(gateway.engine.requests) == 1
    assert gateway.engine.requests[0].sampling.max_tokens == 3
