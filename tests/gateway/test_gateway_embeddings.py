"""The /v1/embeddings parser and shaper (no engine): OpenAI's input forms, its base64 encoding, the errors."""

from __future__ import annotations

import base64
import struct

import pytest

from steploop.gateway.embeddings_api.outputs import embeddings_body, encode
from steploop.gateway.embeddings_api.protocol import parse_embeddings
from steploop.gateway.errors import APIError


@pytest.mark.parametrize("value,want", [
    ("hi", ("hi",)), (["a", "b"], ("a", "b")), ([1, 2, 3], ((1, 2, 3),)), ([[1], [2, 3]], ((1,), (2, 3))),
])
def test_input_forms(value, want):
    req = parse_embeddings({"input": value, "user": "u-1"}, vocab_size=100)
    assert req.inputs == want and req.encoding_format == "float" and req.dimensions is None and req.user == "u-1"


@pytest.mark.parametrize("body,code,param", [
    ({}, "missing_required_parameter", "input"), ({"input": ""}, "empty_input", "input"),
    ({"input": []}, "empty_input", "input"), ({"input": [[]]}, "empty_input", "input"),
    ({"input": [1, "a"]}, "invalid_type", "input"), ({"input": True}, "invalid_type", "input"),
    ({"input": [5, 500]}, "invalid_value", "input"), ({"input": ["a"] * 2049}, "invalid_value", "input"),
    ({"input": "a", "encoding_format": "hex"}, "invalid_value", "encoding_format"),
    ({"input": "a", "dimensions": 0}, "invalid_value", "dimensions"),
    ({"input": "a", "dimensions": "8"}, "invalid_type", "dimensions"),
])
def test_bad_bodies_name_the_field(body, code, param):
    with pytest.raises(APIError) as err:
        parse_embeddings(body, vocab_size=100)
    assert (err.value.status, err.value.code, err.value.param) == (400, code, param)


def test_base64_is_little_endian_float32_as_openai():
    vector = [0.5, -1.25, 3.0e-3]
    raw = base64.b64decode(encode(vector, "base64"))
    assert list(struct.unpack("<3f", raw)) == pytest.approx(vector, rel=1e-7)
    body = embeddings_body("embd-1", "m", [vector, vector], 7, "float")
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][1]["embedding"] == vector


async def test_a_generate_model_refuses_embeddings_and_says_what_it_serves(gateway):
    from tests.gateway.conftest import SERVED_NAME
    from tests.gateway.test_gateway_errors import assert_error, post
    status, body, _ = await post(gateway, "/v1/embeddings", {"model": SERVED_NAME, "input": "hi"})
    assert status == 400 and body["error"]["message"] == "The model does not support Embeddings API", body
    assert_error(body, param="model", code="model_not_supported")
    assert gateway.engine.requests == []          # refused before it reached the engine
    models = await gateway.openai().models.list()
    assert models.data[0].model_extra["tasks"] == ["generate"]
