"""The model's generation_config sampling defaults (ModelInfo.generation_defaults) as the gateway applies them, as
vLLM's --generation-config auto: a field the request leaves unset takes the model's value, one it sets keeps its
own, on every endpoint; max_new_tokens is the default max_tokens and caps a larger one (vLLM's get_max_tokens)."""

from __future__ import annotations

import pytest

from steploop.common.generation_defaults import GenerationDefaults
from steploop.common.pb.steploop.v1 import engine_pb2
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.test_gateway_errors import CHAT, post

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                  "max_tokens": 7}


@pytest.fixture
def fake_engine(reply_ids) -> FakeEngine:
    return FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], generation_defaults=MODEL_DEFAULTS)


def sent(gateway) -> dict:
    s = gateway.engine.requests[-1].sampling
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": s.max_tokens if s.HasField("max_tokens") else None}


def test_defaults_round_trip_the_wire_as_the_file_says():
    defaults = GenerationDefaults(**MODEL_DEFAULTS)
    assert GenerationDefaults.from_pb(defaults.to_pb()) == defaults          # float32 on the wire, 0.6 back
    assert GenerationDefaults.from_pb(engine_pb2.GenerationDefaults()) == GenerationDefaults()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi"}),
    ("/v1/responses", {"model": SERVED_NAME, "input": "hi"}),
])
async def test_unset_fields_take_the_models_defaults(gateway, path, body):
    status, resp, _ = await post(gateway, path, body)
    assert status == 200, resp
    assert sent(gateway) == pytest.approx(MODEL_DEFAULTS)


async def test_messages_take_them_too(gateway):
    body = {"model": SERVED_NAME, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    assert (await post(gateway, "/v1/messages", body))[0] == 200
    assert sent(gateway) == pytest.approx(MODEL_DEFAULTS)


async def test_fields_the_request_sets_win(gateway):
    own = {"temperature": 1.3, "top_p": 0.5, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 3}
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, **own}))[0] == 200
    assert sent(gateway) == pytest.approx(own)


async def test_max_new_tokens_caps_a_larger_max_tokens(gateway):
    assert (await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 500}))[0] == 200
    assert sent(gateway)["max_tokens"] == 7
