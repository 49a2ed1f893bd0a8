"""vLLM's user grammars at the gateway: guided_grammar / structured_outputs.grammar (EBNF), structural_tag /
structured_outputs.structural_tag (xgrammar's JSON, vLLM's older {structures, triggers} form rewritten to it) reach
the engine as one constraint; malformed values and two constraints at once are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from steploop.common.sampling_params import SamplingParams
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

COMPLETION = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
GRAMMAR = 'root ::= "yes" | "no" | [0-9]+'
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
    {"type": "tag", "begin": "<f>", "end": "</f>", "content": {"type": "json_schema", "json_schema": {
        "type": "object"}}}]}}
LEGACY_TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
              "triggers": ["<f"]}


@pytest.mark.parametrize("path, base", ENDPOINTS)
@pytest.mark.parametrize("extra, field, value", [
    ({"guided_grammar": GRAMMAR}, "grammar", GRAMMAR),
    ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar", GRAMMAR),
    ({"structural_tag": json.dumps(TAG)}, "structural_tag", TAG),
    ({"structural_tag": TAG}, "structural_tag", TAG),
    ({"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}}, "structural_tag", TAG),
    ({"guided_regex": "[a-c]{2}", "structured_outputs": {"json_object": False}}, "regex", "[a-c]{2}"),
])
async def test_the_constraint_reaches_the_engine(gateway, path, base, extra, field, value):
    status, body, _ = await post(gateway, path, {**base, **extra})
    assert status == 200, body
    sent = SamplingParams.from_pb(gateway.engine.requests[-1].sampling)
    assert sent.constraint_fields == [field]
    got = getattr(sent, field)
    assert (json.loads(got) if field == "structural_tag" else got) == value


@pytest.mark.parametrize("path, base", ENDPOINTS)
@pytest.mark.parametrize("extra, field", [
    ({"guided_grammar": GRAMMAR, "guided_regex": "a"}, "guided_grammar"),
    ({"guided_grammar": GRAMMAR, "structural_tag": TAG}, "structural_tag"),
    ({"structured_outputs": {"grammar": GRAMMAR, "regex": "a"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": GRAMMAR}, "response_format": {"type": "json_object"}},
     "structured_outputs.grammar"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_grammar": 3}, "guided_grammar"),
    ({"structural_tag": "not json"}, "structural_tag"),
    ({"structural_tag": "[1]"}, "structural_tag"),
    ({"structural_tag": {"structures": [{"begin": 1}], "triggers": ["<"]}}, "structural_tag"),
    ({"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}}},
     "structured_outputs.structural_tag"),
])
async def test_malformed_or_conflicting_constraints_are_400s(gateway, path, base, extra, field):
    status, body, _ = await post(gateway, path, {**base, **extra})
    assert status == 400, body
    assert_error(body, param=field)
    assert gateway.engine.requests == []
