"""allowed_token_ids and bad_words at the gateway (openai_api/token_controls.py): parsed, checked against the
vocabulary (400 naming the field), bad words tokenized as vLLM does, and carried to the engine."""

from __future__ import annotations

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.gateway.openai_api.token_controls import bad_words_token_ids
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

COMPLETION = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}
ENDPOINTS = [("/v1/chat/completions", {**CHAT, "max_tokens": 2}), ("/v1/completions", COMPLETION)]


@pytest.mark.parametrize("path, base", ENDPOINTS)
async def test_controls_reach_the_engine(gateway, tokenizer, path, base):
    status, resp, _ = await post(gateway, path, {**base, "allowed_token_ids": [9, 5, 9], "bad_words": ["Paris"],
                                                 "logit_bias": {"5": 2}})
    assert status == 200, resp
    sent = SamplingParams.from_pb(gateway.engine.requests[-1].sampling)
    assert sent.allowed_token_ids == (5, 9) and sent.logit_bias == ((5, 2.0),)
    plain = tuple(tokenizer.encode_sync("Paris", add_special_tokens=False))
    spaced = tuple(tokenizer.encode_sync(" Paris", add_special_tokens=False))
    assert sent.bad_words == (plain, spaced)              # at the start of a text and after a space


@pytest.mark.parametrize("path, base", ENDPOINTS)
@pytest.mark.parametrize("field, value", [
    ("allowed_token_ids", [1, 49152]), ("allowed_token_ids", [-1]), ("allowed_token_ids", "1"),
    ("allowed_token_ids", [1.5]), ("bad_words", "no"), ("bad_words", [""]), ("bad_words", ["  "]),
    ("bad_words", [3]), ("bad_words", ["x" * 2000])])
async def test_bad_values_are_400s_naming_the_field(gateway, path, base, field, value):
    status, resp, _ = await post(gateway, path, {**base, field: value})
    assert status == 400, resp
    assert_error(resp, param=field)
    assert gateway.engine.requests == []


async def test_a_bad_word_outside_the_models_vocabulary_is_refused(tokenizer):
    from steploop.gateway.errors import APIError
    ids = tokenizer.encode_sync("zebra", add_special_tokens=False)
    with pytest.raises(APIError) as err:
        await bad_words_token_ids(tokenizer, ("zebra",), max(ids))
    assert err.value.param == "bad_words"


async def test_leading_spaces_do_not_double_the_space(tokenizer):
    """vLLM strips a word's leading spaces, then adds one: "  Paris" is banned as "Paris" and " Paris"."""
    assert await bad_words_token_ids(tokenizer, ("  Paris",), None) == \
        await bad_words_token_ids(tokenizer, ("Paris",), None)
