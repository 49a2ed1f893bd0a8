"""KV tiers with the real model: the real Scheduler drives a real ModelRunner (in process, no gRPC) over a pool too
small for the conversations, so prefix blocks are demoted to host memory and disk, preempted requests come back,
returning turns restore their prefix; greedy tokens must equal those of the same workload with tiers off. Then
the worker "restarts" (a fresh host tier and pool, the same disk folder): the scheduler indexes the disk back and a
returning prompt is restored from disk; a flipped byte in a block file is a logged checksum miss and the text is
still right."""

from __future__ import annotations

import logging
import random

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.kv_disk_tier import DiskTier
from steploop.gpu_worker.kv_tier_mover import KvTierMover
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.kv_tiers import KvTiers, check_move_order
from steploop.scheduler.request import Request

pytestmark = pytest.mark.slow

BLOCK, POOL = 16, 14            # 13 usable blocks = 208 tokens: two 100-token conversations do not fit together


@pytest.fixture(scope="module")
def tier_runner(model_dir, tmp_path_factory):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    disk = tmp_path_factory.mktemp("kv_disk")
    config = WorkerConfig(model=str(model_dir), num_kv_blocks=POOL, max_model_len=(POOL - 1) * BLOCK, device="cpu",
                          block_size=BLOCK, kv_offloading_size=0.02, kv_disk_path=str(disk), kv_disk_size=0.05)
    runner = ModelRunner.from_config(config, model_dir)
    assert runner.info.kv_host_blocks > 0 and runner.info.kv_disk_blocks > 0
    return runner


def scheduler_for(runner, tiers: bool):
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=True)
    kv = KVCacheManager(runner.info.num_kv_blocks, BLOCK, True)
    sched = make_scheduler(config, kv, runner.info.max_model_len, list(runner.info.eos_token_ids))
    if tiers:
        info = runner.info
        mover = runner.tiers
        kv.attach_tiers(KvTiers(mover.num_host_blocks, mover.disk_blocks, mover.block_bytes, mover.disk_hashes()))
        assert info.kv_block_bytes == mover.block_bytes
    return sched


def serve(runner, sched, requests: list[list[Request]]) -> dict[str, list[int]]:
    """Each inner list arrives once the previous one finished (returning turns)."""
    runner.reset()
    out: dict[str, list[int]] = {}
    for wave in requests:
        for r in wave:
            sched.add_request(r)
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            check_move_order(plan.kv_moves)
            result = runner.execute(plan)
            assert not result.error, result.error
            for o in sched.update_from_output(plan, result):
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    return out


def conversations(seed: int = 0) -> list[list[Request]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 20000) for _ in range(100)] for _ in range(3)]
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    first = [Request(f"c{i}-t1", h, sampling=greedy(12)) for i, h in enumerate(heads)]
    second = [Request(f"c{i}-t2", h + [rng.randrange(100, 20000) for _ in range(20)], sampling=greedy(6))
              for i, h in enumerate(heads)]
    return [first, second]


def test_tiers_on_and_off_give_the_same_tokens_and_restore(tier_runner):
    want = serve(tier_runner, scheduler_for(tier_runner, False), conversations())
    sched = scheduler_for(tier_runner, True)
    got = serve(tier_runner, sched, conversations())
    assert got == want
    stats = sched.kv.tiers.stats
    assert stats["CPU"].blocks_in > 0, "nothing was demoted"
    assert stats["CPU"].hits > 0, "no returning turn was restored from host memory"
    assert sched.num_preemptions > 0 or stats["CPU"].hits >= BLOCK


def restarted(runner) -> None:
    """A new worker process on the same disk folder: empty host memory and pool, files indexed back."""
    old = runner.tiers
    disk = DiskTier(old.disk.folder.parent, old.disk.fingerprint, old.disk.payload_bytes)
    runner.tiers = KvTierMover(runner.kv_caches, old.num_host_blocks, disk, old.disk_blocks)
    for cache in runner.kv_caches:
        cache.zero_()


def test_restart_restores_from_disk_and_a_flipped_byte_is_a_miss(tier_runner, caplog):
    long_prompt = [random.Random(5).randrange(100, 20000) for _ in range(150)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = serve(tier_runner, scheduler_for(tier_runner, False), [[Request("ref", long_prompt, sampling=greedy)]])
    # Serve it with tiers, then push its blocks out of the pool and host memory, down to disk.
    sched = scheduler_for(tier_runner, True)
    filler = [[Request(f"f{i}", [random.Random(i).randrange(100, 20000) for _ in range(190)],
                       sampling=SamplingParams(max_tokens=1))] for i in range(4)]
    serve(tier_runner, sched, [[Request("a", long_prompt, sampling=greedy)]] + filler)
    assert sched.kv.tiers.stats["DISK"].blocks_in > 0, "nothing reached the disk"

    restarted(tier_runner)
    sched = scheduler_for(tier_runner, True)
    assert sched.kv.tiers.disk.entries, "the restarted worker's disk was not indexed"
    got = serve(tier_runner, sched, [[Request("b", long_prompt, sampling=greedy)]])
    assert got["b"] == want["ref"]
    assert sched.kv.tiers.stats["DISK"].hits > 0, "no block came back from disk"

    restarted(tier_runner)
    files = sorted(tier_runner.tiers.disk.folder.glob("*.kvb"))
    for f in files:                               # flip one byte in the payload of every file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    sched = scheduler_for(tier_runner, True)
    with caplog.at_level(logging.WARNING, "steploop.gpu_worker.kv_disk_tier"):
        got = serve(tier_runner, sched, [[Request("c", long_prompt, sampling=greedy)]])
    assert got["c"] == want["ref"]
    assert "checksum mismatch" in caplog.text
    assert sched.kv.tiers.stats["DISK"].misses > 0
