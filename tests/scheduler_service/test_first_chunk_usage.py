"""The chunk with a request's first tokens carries its usage so far, so a caller that stops reading early (the
gateway, at a stop string) still knows the prompt tokens served from the prefix cache; later chunks carry none
until the last. Over real gRPC, on both the per-request Generate call and the multiplexed Session stream."""

from __future__ import annotations

from steploop.client import EngineClient, EngineRequest, SamplingParams
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker

PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]   # two full blocks of 4, and two tokens more


async def test_first_chunk_with_tokens_reports_cached_tokens(service):
    worker = FakeGrpcWorker(service.address).start()
    try:
        for multiplex in (False, True):
            client = EngineClient(service.address, multiplex=multiplex)
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            [c async for c in client.generate(EngineRequest(f"warm-{multiplex}", PROMPT, params))]
            chunks = [c async for c in client.generate(EngineRequest(f"hit-{multiplex}", PROMPT, params))]
            first = next(c for c in chunks if c.token_ids)
            assert first.usage is not None and first.usage.cached_tokens == 8
            assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(PROMPT), len(first.token_ids))
            assert all(c.usage is None for c in chunks[chunks.index(first) + 1:-1])
            assert chunks[-1].usage.cached_tokens == 8 and chunks[-1].usage.completion_tokens == 6
            await client.close()
    finally:
        await worker.kill()
