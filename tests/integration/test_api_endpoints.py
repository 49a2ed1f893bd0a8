"""The REST API's other routes (/tokenize, /detokenize, /version, /v1/models, /openapi.json), the gRPC client
against the real scheduler, and schemathesis fuzzing from /openapi.json: no 5xx, no hang, no leaked KV block."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from tests.integration.api_helpers import MODEL, client
from tests.openapi_fuzz import fuzz_operation

pytestmark = pytest.mark.slow


def _get(cluster, path):
    with urllib.request.urlopen(cluster.base_url + path, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_tokenize_detokenize_version_models(cluster, hf):
    status, body = cluster.post("/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and body["tokens"] == hf.text_ids("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    messages = [{"role": "user", "content": "Hi"}]
    status, body = cluster.post("/tokenize", {"messages": messages, "add_generation_prompt": True})
    assert status == 200 and body["tokens"] == hf.chat_ids(messages)
    status, body = cluster.post("/detokenize", {"tokens": hf.text_ids("Hello world")})
    assert status == 200 and body["prompt"] == hf.tokenizer.decode(hf.text_ids("Hello world"))
    status, body = cluster.post("/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert _get(cluster, "/version")[1]["version"]
    assert _get(cluster, "/openapi.json")[1]["paths"]["/v1/completions"]["post"]
    assert [m.id for m in client(cluster).models.list().data] == [MODEL]


def test_chat_options_and_cached_tokens(cluster):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "The fruit is"}]
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 4,
                  "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    first = client(cluster).chat.completions.create(**kwargs)
    again = client(cluster).chat.completions.create(**kwargs)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0      # the same prompt hits the prefix cache
    cut = client(cluster).chat.completions.create(**kwargs, stop=[first.choices[0].message.content.strip()[:2]])
    assert cut.choices[0].finish_reason == "stop"                    # a stop string: the engine call is cut short
    assert cut.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    stream = client(cluster).chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.prompt_tokens == first.usage.prompt_tokens


def test_grpc_client_generate_and_abort(cluster, hf):
    from steploop.client import EngineClient, EngineRequest, FinishReason, SamplingParams

    async def run():
        engine = EngineClient(cluster.scheduler_address)
        ids = hf.text_ids("The quick brown fox")
        tokens, last = [], None
        async for chunk in engine.generate(EngineRequest("grpc-1", ids, SamplingParams(max_tokens=6, logprobs=1))):
            tokens.extend(chunk.token_ids)
            last = chunk
        assert tokens == hf.greedy_ids(ids, 6)[:len(tokens)] and last.usage.completion_tokens == len(tokens)
        assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        long = engine.generate(EngineRequest("grpc-2", ids, SamplingParams(max_tokens=2000, ignore_eos=True)))
        await anext(long)
        assert await engine.abort(["grpc-2"]) == 1
        rest = [c async for c in long]
        assert rest[-1].finish_reason == FinishReason.ABORT
        await engine.close()

    asyncio.run(run())


def _health_503(op, status: int) -> bool:
    return op.path == "/health" and status == 503   # /health's contract: 503 while the engine is not ready


def _narrowed_for_speed(spec: dict) -> dict:
    """The server's spec states its real limits; on 2 CPU cores the fuzzer keeps generations and prompts short
    (unset max_tokens means "what fits": ~8k tokens, minutes here)."""
    limits = {"max_tokens": 16, "max_completion_tokens": 16, "min_tokens": 16, "n": 4, "max_output_tokens": 16}
    for path, cap_field in (("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                            ("/v1/messages", "max_tokens"), ("/v1/responses", "max_output_tokens")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        if cap_field not in body["required"]:
            body["required"].append(cap_field)
        for name, cap in limits.items():
            if name in body["properties"]:
                body["properties"][name]["maximum"] = cap
        for prompt_form in body["properties"].get("prompt", {}).get("oneOf", []):
            prompt_form.setdefault("maxLength" if prompt_form.get("type") == "string" else "maxItems", 64)
            if prompt_form.get("items", {}).get("type") == "string":
                prompt_form["items"]["maxLength"] = 64
        if "messages" in body["properties"]:
            body["properties"]["messages"]["maxItems"] = 6
            body["properties"]["messages"]["items"]["properties"]["content"]["oneOf"][0]["maxLength"] = 200
    return spec


def test_schemathesis_finds_no_server_errors_and_leaks_nothing(cluster):
    import schemathesis

    with urllib.request.urlopen(cluster.base_url + "/openapi.json", timeout=30) as resp:
        spec = json.loads(resp.read())
    schema = schemathesis.openapi.from_dict(_narrowed_for_speed(spec))
    failures: list[str] = []
    deadline = time.monotonic() + 50
    for operation in schema.get_all_operations():
        op = operation.ok()
        examples = 40 if op.path in ("/v1/completions", "/v1/chat/completions") else 10
        fuzz_operation(op, cluster.base_url, failures, deadline, examples=examples, allowed_5xx=_health_503)
    assert failures == []
    # Still answers correctly, and once idle every KV block is free (cached prefix blocks count as free).
    r = client(cluster).completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=3)
    assert r.choices[0].text
    for _ in range(100):
        load = cluster.load_report()
        if load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks - 1:
            break
        time.sleep(0.1)
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert load.num_free_blocks == load.num_total_blocks - 1
