"""Beam search through the scheduler service over real gRPC (GenerateRequest.beam_search), its worker a paged fake
running a tiny transformers Llama (tests/scheduler/beam_worker.py): the one chunk carries the hypotheses, equal to
transformers' generate(num_beams=W); a call cancelled mid-beam aborts every beam and leaves no block held."""

from __future__ import annotations

import dataclasses

import pytest

from steploop.common.beam_ranking import BeamConfig
from steploop.common.engine_contract import EngineChunk, beam_config_to_pb
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.sampling_params import SamplingParams
from tests.scheduler.beam_worker import PagedFakeWorker
from tests.beam_model import EOS, VOCAB, tiny_beam_llama
from tests.scheduler.test_beam_groups import hf_beams
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker
from tests.scheduler_service.test_engine_service import until

pytestmark = pytest.mark.asyncio
BLOCKS = 256


@pytest.fixture(scope="module")
def tiny():
    return tiny_beam_llama(128)


def worker_for(service, tiny, step_delay=0.0) -> FakeGrpcWorker:
    worker = FakeGrpcWorker(service.address, num_kv_blocks=BLOCKS, step_delay=step_delay)
    worker.info = dataclasses.replace(worker.info, vocab_size=VOCAB, eos_token_ids=(EOS,))
    worker.worker = PagedFakeWorker(tiny, BLOCKS, worker.info.block_size)
    return worker.start()


def beam_request(rid, prompt, width, max_tokens):
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=max_tokens).to_pb(),
                                      beam_search=beam_config_to_pb(BeamConfig(width)))


async def test_one_chunk_with_the_beams(service, engine, tiny):
    stub, _ = engine
    worker = worker_for(service, tiny)
    prompt = [1, 17, 42, 8]
    chunks = [EngineChunk.from_pb(c) async for c in stub.Generate(beam_request("b", prompt, 4, 7))]
    assert len(chunks) == 1 and chunks[0].finished and not chunks[0].token_ids
    assert [h.tokens for h in chunks[0].beams] == [t for t, _ in hf_beams(tiny, prompt, 4, 1.0, False)]
    assert chunks[0].usage.prompt_tokens == len(prompt)
    await until(lambda: service.loop.scheduler.kv.num_free_blocks == BLOCKS - 1, "every KV block free")
    service.loop.check_idle()
    await worker.kill()


async def test_cancel_mid_beam_frees_every_block(service, engine, tiny):
    stub, _ = engine
    worker = worker_for(service, tiny, step_delay=0.02)
    call = stub.Generate(beam_request("b", [1, 9, 9, 33, 71, 2], 4, 40))
    sched = lambda: service.loop.scheduler
    await until(lambda: sched() is not None and len(sched().requests) >= 3, "the beams forked")
    held = sched().kv.num_usable_blocks - sched().kv.num_free_blocks
    assert held > 0
    call.cancel()
    await until(lambda: not sched().has_unfinished_requests(), "the cancelled beam search aborted")
    assert not sched().beam_groups and not service.loop.streams
    await until(lambda: sched().kv.num_free_blocks == BLOCKS - 1, "0 blocks leaked")
    sched().check_integrity()
    await worker.kill()
