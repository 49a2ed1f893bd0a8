"""Through the real cluster: a constraint that cannot be enforced as written is a 400 naming the field at the
gateway, and one that reaches the worker anyway (sent straight to the Engine API, past the gateway's check) ends
that request alone with FINISH_REASON_REJECTED while a request beside it in the same steps completes; afterwards
nothing is left running and every KV block is free."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.api_helpers import MODEL
from tests.integration.cluster import assert_healthy_and_no_leak

pytestmark = pytest.mark.slow

LOOKAHEAD = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}},
             "required": ["code"]}


async def _generate(stub, request_id: str, sampling: engine_pb2.SamplingParams) -> list[engine_pb2.GenerateChunk]:
    prompt = list(range(100, 130))
    call = stub.Generate(engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                                    sampling=sampling), timeout=120)
    return [chunk async for chunk in call]


async def _side_by_side(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        bad = engine_pb2.SamplingParams(max_tokens=8, json_schema=json.dumps(LOOKAHEAD))
        good = engine_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
        return await asyncio.gather(_generate(stub, "bad", bad), _generate(stub, "good", good))


def test_unenforceable_constraints_are_errors_and_fail_alone(cluster):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a code."}], "max_tokens": 16}
    status, body = cluster.post("/v1/chat/completions", {**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "code", "schema": LOOKAHEAD}}})
    assert status == 400 and body["error"]["param"] == "response_format.json_schema", body
    assert "lookahead" in body["error"]["message"]
    status, body = cluster.post("/v1/chat/completions", {**chat, "guided_regex": "(ab"})
    assert status == 400 and body["error"]["param"] == "guided_regex" and "does not compile" in body["error"]["message"]

    bad, good = asyncio.run(_side_by_side(cluster.scheduler_address))
    last = bad[-1]
    assert last.finish_reason == engine_pb2.FINISH_REASON_REJECTED, bad
    assert (last.error_code, last.error_param) == ("invalid_grammar", "json_schema")
    assert "lookahead" in last.error_message and not any(c.token_ids for c in bad)
    assert good[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in good) == 8
    assert_healthy_and_no_leak(cluster)
