"""The router keys prompts by the schedulers' own prefix-cache block hashes (services/common/block_hashing.py):
same prompt and cache salt, same keys, with the block size the replicas report in ModelInfo."""

from __future__ import annotations

import random

import pytest

from steploop.common.block_hashing import block_hashes, get_block_hasher
from steploop.common.engine_contract import EngineRequest
from steploop.common.sampling_params import SamplingParams
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.router import EngineRouter
from steploop.scheduler.request import Request
from tests.gateway.fake_engine import FakeEngine, start_fake_engine
from tests.scheduler.sched_factories import FakeWorker, create_scheduler, run_until_idle


def scheduler_hashes(prompt: list[int], block_size: int, salt: str) -> list[bytes]:
    """The keys a real Scheduler gives the prompt's full blocks (its prefix cache hashes them at admission)."""
    sched = create_scheduler(block_size=block_size, max_model_len=4096)
    request = Request("r", list(prompt), sampling=SamplingParams(max_tokens=1), cache_salt=salt or None)
    sched.add_request(request)
    run_until_idle(sched, FakeWorker(block_size=block_size))
    return request.block_hashes[:len(prompt) // block_size]


@pytest.mark.parametrize("salt", ["", "tenant-a"])
async def test_router_hashes_equal_the_schedulers_for_the_same_prompt_and_salt(reply_ids, salt):
    engines = [FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], block_size=8) for _ in range(2)]
    started = [await start_fake_engine(e) for e in engines]
    router = EngineRouter([EngineClient(address) for _, address, _ in started])
    prompt = random.Random(7).sample(range(100, 900), 45)        # 5 full blocks of 8, and 5 tokens over
    try:
        assert router.affinity.block_hashes(prompt) == []          # block size not known yet: no keys
        request = EngineRequest("r", prompt, SamplingParams(max_tokens=2), cache_salt=salt)
        chunks = [c async for c in router.generate(request)]
        assert chunks[-1].finished
        assert router.affinity.block_size == 8                     # from the replicas' ModelInfo
        keys = router.affinity.block_hashes(prompt, salt)
        assert len(keys) == 5 and keys == scheduler_hashes(prompt, 8, salt)
        assert all(router.affinity._map.get(k) is not None for k in keys)   # recorded for the next request
        assert router.affinity.block_hashes(prompt, salt + "x") != keys     # another tenant shares nothing
    finally:
        await router.close()
        for server, _, _ in started:
            await server.stop(None)


def test_hash_functions_are_chosen_by_name():
    assert get_block_hasher("sha256") is get_block_hasher()
    assert block_hashes([1, 2, 3, 4, 5], 4, "s", get_block_hasher("sha256")) == block_hashes([1, 2, 3, 4], 4, "s")
    with pytest.raises(ValueError, match="sha256"):
        get_block_hasher("md5")
