"""Scheduler metrics after a known workload (real SchedulerService over gRPC, fake worker): every count equals
what the workload produced, and every histogram observed every request."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import grpc
import pytest

from steploop.common import grpc_options
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.server import SchedulerService
from steploop.scheduler.server_config import ServerConfig
from tests.observability.scrape import parse, value
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker

pytestmark = pytest.mark.asyncio
MODEL = {"model_name": "fake-model"}
PER_REQUEST = ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
               "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
               "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
               "vllm:request_generation_tokens")


async def start(metrics_port: int = 0, **sched) -> SchedulerService:
    svc = SchedulerService(SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 8, **sched}),
                           ServerConfig(host="127.0.0.1", port=0, worker_timeout=5, shutdown_timeout=1.0,
                                        metrics_port=metrics_port, log_stats_interval=0))
    await svc.start()
    svc.address = f"127.0.0.1:{svc.port}"
    return svc


async def run(svc: SchedulerService, prompts: list[list[int]], max_tokens: int, sequential: bool = False):
    async with grpc.aio.insecure_channel(svc.address, options=grpc_options.CLIENT) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def one(i: int, prompt: list[int]) -> int:
            req = engine_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True).to_pb())
            n = 0
            async for chunk in stub.Generate(req):
                n += len(chunk.token_ids)
            return n

        if sequential:
            counts = [await one(i, p) for i, p in enumerate(prompts)]
        else:
            counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        text = (await stub.GetMetrics(engine_pb2.MetricsRequest())).text
    return counts, parse(text)


async def test_counts_and_histograms_match_the_workload():
    svc = await start(metrics_port=0)
    worker = FakeGrpcWorker(svc.address).start()
    prompts = [[11 + i] * (5 + 7 * i) for i in range(5)]       # 5..33 tokens: chunked at budget 16
    try:
        counts, s = await run(svc, prompts, max_tokens=6)
    finally:
        await worker.kill()
        await svc.stop()
    assert counts == [6] * 5
    assert value(s, "vllm:prompt_tokens_total", **MODEL) == sum(map(len, prompts))
    assert value(s, "vllm:generation_tokens_total", **MODEL) == 30
    assert value(s, "vllm:request_success_total", finished_reason="length") == 5
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 0
    for name in PER_REQUEST:
        assert value(s, name + "_count", **MODEL) == 5, name
    assert value(s, "vllm:inter_token_latency_seconds_count") == 5 * 5          # one per token after the first
    assert value(s, "vllm:time_per_output_token_seconds_count") == 5 * 5
    assert value(s, "vllm:request_generation_tokens_sum") == 30
    assert value(s, "vllm:request_prompt_tokens_sum") == sum(map(len, prompts))
    steps = value(s, "steploop:steps_total")
    assert value(s, "vllm:iteration_tokens_total_count") == steps > 0
    assert value(s, "vllm:iteration_tokens_total_sum") == sum(map(len, prompts)) + 5 * 5   # last token: no KV
    assert value(s, "steploop:step_duration_seconds_count") == steps
    assert value(s, "vllm:num_requests_running") == value(s, "vllm:num_requests_waiting") == 0
    assert value(s, "vllm:kv_cache_usage_perc") == 0
    assert value(s, "vllm:cache_config_info", block_size="4", num_gpu_blocks="256", cache_dtype="auto") == 1
    assert value(s, "steploop:worker_attaches_total") == 1 and value(s, "steploop:plan_bytes_total") > 0
    # the fake worker reports no forward time, so the pacer's model never fits and never cuts a chunk
    assert value(s, "steploop:prefill_paced_steps_total") == value(s, "steploop:prefill_deferred_tokens_total") == 0
    exported = {name for name, _ in s}
    for name in dashboard_metrics():                                # the Grafana dashboard reads only these
        assert name in exported, name


def dashboard_metrics() -> set[str]:
    import json
    import pathlib
    import re
    path = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "steploop.json"
    exprs = [t["expr"] for panel in json.loads(path.read_text())["panels"] for t in panel["targets"]]
    return {n for e in exprs for n in re.findall(r"(?:vllm|steploop):[a-z0-9_]+", e)}


async def test_preemptions_with_a_tiny_kv_pool_and_the_http_endpoint():
    svc = await start(metrics_port=0)
    await svc.metrics_server.start("127.0.0.1", 0)               # port 0: any free port
    worker = FakeGrpcWorker(svc.address, num_kv_blocks=12).start()   # 11 usable blocks of 4 tokens
    prompts = [[21 + i] * 10 for i in range(4)]                   # 4 x 5 blocks at the end: must preempt
    try:
        counts, s = await run(svc, prompts, max_tokens=10)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{svc.metrics_server.port}/metrics") as resp:
                assert resp.status == 200
                h = parse(await resp.text())
        preemptions = svc.loop.scheduler.num_preemptions
    finally:
        await worker.kill()
        await svc.stop()
    assert counts == [10] * 4
    assert preemptions > 0
    assert value(s, "vllm:num_preemptions_total", **MODEL) == value(h, "vllm:num_preemptions_total") == preemptions
    assert value(h, "vllm:generation_tokens_total") == 40
    assert value(h, "vllm:e2e_request_latency_seconds_count") == 4


async def test_prefix_cache_hits_on_a_repeated_prompt(caplog):
    svc = await start()
    worker = FakeGrpcWorker(svc.address).start()
    prompt = list(range(30, 47))                                  # 17 tokens: 4 full blocks of 4
    try:
        with caplog.at_level(logging.INFO, logger="steploop.scheduler.stats"):
            _, s = await run(svc, [prompt, prompt], max_tokens=2, sequential=True)
            svc.loop.observer.log_stats()
    finally:
        await worker.kill()
        await svc.stop()
    assert value(s, "vllm:prefix_cache_queries_total", **MODEL) == 34
    assert value(s, "vllm:prefix_cache_hits_total", **MODEL) == 16
    finished = [r for r in caplog.records if r.getMessage().startswith("finished ")]
    assert [(r.request_id, r.output_tokens, r.cached_tokens) for r in finished] == [("r0", 2, 0), ("r1", 2, 16)]
    stats = [r for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert len(stats) == 1 and stats[0].prefix_hit_rate == round(16 / 34, 4)


async def test_aborts_are_counted_by_reason():
    svc = await start()
    worker = FakeGrpcWorker(svc.address, step_delay=0.01).start()
    try:
        async with grpc.aio.insecure_channel(svc.address, options=grpc_options.CLIENT) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            call = stub.Generate(engine_pb2.GenerateRequest(request_id="gone", prompt_token_ids=[5] * 8,
                                 sampling=SamplingParams(max_tokens=300, ignore_eos=True).to_pb()))
            async for _ in call:
                break
            call.cancel()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not svc.loop.streams:
                    break
            s = parse((await stub.GetMetrics(engine_pb2.MetricsRequest())).text)
    finally:
        await worker.kill()
        await svc.stop()
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(s, "steploop:request_aborts_total", reason="cancelled") == 1
    assert value(s, "vllm:e2e_request_latency_seconds_count") == 1
