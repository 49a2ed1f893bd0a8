"""Cross-replica KV pull with real processes: two scheduler replicas (KV events on), each with a worker that sends
and receives KV blocks (--kv-role both), behind one gateway with --enable-kv-pull. A prompt served on one replica
and then routed to the other (the first is busy) is pulled from the first instead of recomputed, with the same
greedy text; a pull whose source no longer holds the blocks, or is gone, is a counted recompute with the right
tokens; at idle every block of both replicas is free."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random

import pytest

from steploop.common.engine_contract import EngineRequest
from steploop.common.kv_pull import KvPullHint
from steploop.common.sampling_params import SamplingParams
from steploop.gateway.engine.engine_client import EngineClient
from tests.integration.cluster import MODEL, Cluster, free_port, is_idle_and_whole, two_replicas
from tests.kv_events.test_kv_events_e2e import events_args
from tests.observability.scrape import parse, value_or_zero

pytestmark = pytest.mark.slow

STORY = ("The old harbour town woke slowly: fishermen mended their nets, the baker opened his shutters, and the "
         "teacher walked down to the pier to watch the boats come in, as every morning. ")
WORKER = ["--kv-role", "both", "--kv-offloading-size", "0.02", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir):
    """Replicas A and B (scheduler + worker each); A's gateway routes over both and may attach pull hints."""
    with two_replicas(tmp_path_factory, "pull", scheduler_args=events_args(), worker_args=WORKER, num_kv_blocks=160,
                      gateway_args=["--enable-kv-pull", "--kv-pull-min-tokens", "32",
                                    "--balance-abs-threshold", "0"]) as replicas:
        yield replicas


def metric(address: str, name: str) -> float:
    async def scrape() -> str:
        client = EngineClient(address)
        try:
            return await client.metrics_text()
        finally:
            await client.close()
    return value_or_zero(parse(asyncio.run(scrape())), name)


def complete(cluster: Cluster, prompt: str) -> tuple[str, str, dict]:
    """(text, the replica that served it, usage) of a greedy completion through the gateway."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200, body
    return body["choices"][0]["text"], resp.getheader("x-steploop-replica"), body["usage"]


@contextlib.contextmanager
def busy(cluster: Cluster, prompt: str):
    """A long streamed generation of `prompt` in flight through the gateway (it goes where the prompt is cached)
    until the block ends; closing the connection aborts it."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 300,
                                                        "temperature": 0, "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200, resp.read()
        assert resp.readline().startswith(b"data:")          # its first token: it is running there
        yield resp.getheader("x-steploop-replica")
    finally:
        conn.close()


def generate(address: str, ids: list[int], hint: KvPullHint | None = None) -> list[int]:
    async def run() -> list[int]:
        client = EngineClient(address)
        try:
            out = []
            async for chunk in client.generate(EngineRequest(f"r-{random.random()}", ids, SamplingParams(
                    max_tokens=6, temperature=0.0), kv_pull=hint)):
                out += chunk.token_ids
            return out
        finally:
            await client.close()
    return asyncio.run(run())


def wait_whole(cluster: Cluster) -> None:
    cluster._wait(lambda: is_idle_and_whole(cluster.load_report()), 60, "not idle with every KV block free")


def test_a_prompt_cached_on_the_busy_replica_is_pulled_by_the_other(pair):
    a, b = pair
    prompt = "Chapter 1. " + STORY * 3                     # ~130 tokens: 8 full blocks
    text, first, _ = complete(a, prompt)                   # computed from scratch: the reference
    other = b.scheduler_address if first == a.scheduler_address else a.scheduler_address
    pulled_before = metric(other, "steploop:kv_pull_blocks_total")
    with busy(a, prompt) as where:
        assert where == first, "the busy stream did not go where the prompt is cached"
        again, second, usage = complete(a, prompt)
    assert second == other, "with its cache's replica busy the prompt did not go to the other"
    assert again == text
    assert metric(other, "steploop:kv_pull_blocks_total") - pulled_before >= 7
    assert metric(first, "steploop:kv_pull_export_blocks_total") >= 7
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 7 * 16, usage
    for cluster in pair:
        wait_whole(cluster)


def test_a_pull_the_source_cannot_serve_is_a_counted_recompute(pair):
    a, b = pair
    ids = random.Random(11).sample(range(1000, 40000), 100)     # 6 full blocks that no replica holds
    reference = generate(a.scheduler_address, ids)
    fallbacks = metric(b.scheduler_address, "steploop:kv_pull_fallbacks_total")
    partly = ids[:50] + ids[50:][::-1]                          # A holds its first 3 blocks, not the rest
    assert generate(b.scheduler_address, partly, KvPullHint(a.scheduler_address, 6)) == \
        generate(a.scheduler_address, partly)                   # A sent 3 blocks; B computed the rest
    fresh = random.Random(12).sample(range(1000, 40000), 100)   # A no longer holds any of it (never did)
    assert generate(b.scheduler_address, fresh, KvPullHint(a.scheduler_address, 6)) == \
        generate(a.scheduler_address, fresh)
    assert generate(b.scheduler_address, ids, KvPullHint(f"127.0.0.1:{free_port()}", 6)) == reference   # A gone
    assert metric(b.scheduler_address, "steploop:kv_pull_fallbacks_total") - fallbacks == 2
    for cluster in pair:
        wait_whole(cluster)
