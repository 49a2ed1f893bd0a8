"""Focused tests: prefix caching, priority policy, watermark, async scheduling, n-gram speculation, worker loss."""

from __future__ import annotations

import argparse

import pytest
from sched_factories import (
    AsyncDriver,
    FakeWorker,
    Run,
    assert_idle,
    create_requests,
    create_scheduler,
    expected_output,
    run_until_idle,
    step,
)
from test_properties import loopy_model

from steploop.common.block_hashing import block_hashes as prompt_block_hashes
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler import policy
from steploop.scheduler.block_pool import BlockPool
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.ngram_proposer import NgramProposer
from steploop.scheduler.request import Request, RequestStatus
from steploop.scheduler.scheduler import Scheduler


# ---------------------------------------------------------------------------------------------- prefix caching
def test_second_request_with_the_same_prompt_hits_its_full_blocks():
    sched = create_scheduler(block_size=4)
    a, b = create_requests(2, prompt_len=18, max_tokens=2, ignore_eos=True)
    b.prompt_token_ids = list(a.prompt_token_ids)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    run_until_idle(sched, worker, run)
    sched.add_request(b)
    plan = step(sched, worker, run)
    assert b.num_cached_tokens == 16 and plan.new_requests[0].num_computed_tokens == 16   # 4 full blocks < 18
    assert plan.num_scheduled_tokens == [2]                    # only the rest of the prompt
    assert plan.new_requests[0].block_ids[:4] == sched.kv.get_block_ids(b)[:4]
    run_until_idle(sched, worker, run)
    assert run.tokens[b.request_id] == expected_output(b)[0]
    assert run.outputs[b.request_id][-1].num_cached_tokens == 16
    assert (sched.kv.prefix_cache_stats.queries, sched.kv.prefix_cache_stats.hits) == (36, 16)


def test_whole_prompt_cached_still_computes_its_last_token():
    sched = create_scheduler(block_size=4)
    a, b = create_requests(2, prompt_len=8, max_tokens=3, ignore_eos=True)
    b.prompt_token_ids = list(a.prompt_token_ids)
    sched.add_request(a)
    worker = FakeWorker()
    run = run_until_idle(sched, worker)
    sched.add_request(b)
    plan = step(sched, worker, run)
    assert b.num_cached_tokens == 4 and plan.num_scheduled_tokens == [4]   # max hit = num_tokens - 1 -> 1 block


def test_shared_blocks_are_ref_counted_while_both_run():
    sched = create_scheduler(block_size=4, max_num_batched_tokens=64)
    a, b = create_requests(2, prompt_len=12, max_tokens=6, ignore_eos=True)
    b.prompt_token_ids = list(a.prompt_token_ids)
    worker, run = FakeWorker(), Run()
    sched.add_request(a)
    step(sched, worker, run)
    sched.add_request(b)
    step(sched, worker, run)
    shared = sched.kv.get_block_ids(a)[:2]
    assert sched.kv.get_block_ids(b)[:2] == shared and all(sched.kv.pool.ref_cnt[x] == 2 for x in shared)
    run_until_idle(sched, worker, run)
    assert run.tokens[a.request_id] == run.tokens[b.request_id] == expected_output(a)[0]


def test_cache_salt_separates_caches():
    sched = create_scheduler(block_size=4)
    prompt = list(range(10, 30))
    a = Request("a", prompt, cache_salt="tenant-1", sampling=SamplingParams(max_tokens=1))
    b = Request("b", list(prompt), cache_salt="tenant-2", sampling=SamplingParams(max_tokens=1))
    c = Request("c", list(prompt), cache_salt="tenant-1", sampling=SamplingParams(max_tokens=1))
    worker = FakeWorker()
    for r in (a, b, c):
        sched.add_request(r)
        run_until_idle(sched, worker)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 16)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes == c.block_hashes


def test_keys_are_deterministic_across_schedulers_and_processes():
    prompt = list(range(100, 137))
    keys = []
    for _ in range(2):
        sched = create_scheduler(block_size=4)
        req = Request("r", list(prompt), sampling=SamplingParams(max_tokens=1))
        sched.add_request(req)
        run_until_idle(sched, FakeWorker())
        keys.append(req.block_hashes)
    assert keys[0] == keys[1] == prompt_block_hashes(prompt, 4)[:len(keys[0])]
    # Pinned: a router computes the same keys (sha256 chain; see services/common/block_hashing.py for the encoding).
    assert prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1].hex()[:16] == "26d6489d9146d820"
    assert prompt_block_hashes([1, 2, 3, 4], 4, "s")[0].hex()[:16] == "dfeef454b1dd4bb0"


def test_eviction_takes_the_tail_of_a_freed_prefix_first():
    sched = create_scheduler(block_size=4, num_blocks=5)      # blocks 1..4
    a = Request("a", list(range(10, 23)), sampling=SamplingParams(max_tokens=1))   # 13 tokens: 3 full + 1
    sched.add_request(a)
    worker = FakeWorker()
    run_until_idle(sched, worker)
    table = [1, 2, 3, 4]
    assert list(sched.kv.pool._free) == [table[3], table[2], table[1], table[0]]   # reversed, keyed ones last
    got = sched.kv.pool.get_new_blocks(2)                     # takes 4 (unkeyed) then 3 (a's tail)
    assert got == [4, 3] and 3 not in sched.kv.pool.block_hash and 1 in sched.kv.pool.block_hash
    sched.kv.pool.free_blocks(reversed(got))
    b = Request("b", list(range(10, 23)), sampling=SamplingParams(max_tokens=1))
    sched.add_request(b)
    step(sched, worker, Run())
    assert b.num_cached_tokens == 8                           # blocks 1, 2 survived


def test_block_pool_touch_and_lazy_eviction():
    pool = BlockPool(4)
    (x,) = pool.get_new_blocks(1)
    pool.cache_block(x, b"k")
    pool.free_blocks([x])
    assert pool.get_cached_block(b"k") == x and pool.num_free_blocks == 3
    pool.touch([x])
    assert pool.ref_cnt[x] == 1 and pool.num_free_blocks == 2
    pool.free_blocks([x])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(b"k") is None
    pool.check_integrity()


# ---------------------------------------------------------------------------------------------- policies
def test_priority_admission_order():
    sched = create_scheduler(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=16)
    low, mid, high = (Request(n, [11, 12, 13], priority=p, arrival_time=t, sampling=SamplingParams(max_tokens=1))
                      for n, p, t in (("low", 2, 0.0), ("mid", 1, 1.0), ("high", 0, 2.0)))
    for r in (low, mid, high):
        sched.add_request(r)
    run = run_until_idle(sched, FakeWorker())
    order = [n.handle for p in run.plans for n in p.new_requests]
    assert order == [high.handle, mid.handle, low.handle]


def test_better_priority_request_preempts_a_worse_running_one():
    sched = create_scheduler(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=16)
    low = Request("low", [11, 12, 13], priority=5, arrival_time=0.0, sampling=SamplingParams(max_tokens=20))
    sched.add_request(low)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    high = Request("high", [14, 15], priority=0, arrival_time=1.0, sampling=SamplingParams(max_tokens=2))
    sched.add_request(high)
    plan = step(sched, worker, run)
    assert plan.preempted_handles == [low.handle] and not plan.new_requests
    plan = step(sched, worker, run)
    assert [n.handle for n in plan.new_requests] == [high.handle]
    assert low.num_preemptions == 1 and sched.num_preemptions == 1
    run_until_idle(sched, worker, run)
    assert run.tokens["low"] == expected_output(low)[0] and run.finish["high"] == RequestStatus.FINISHED_LENGTH


def test_priority_victims_are_named_by_the_policy_and_preempted_by_the_scheduler():
    """victims_for_waiting only answers (worst first, just enough); the scheduler's step then preempts them."""
    sched = create_scheduler(scheduling_policy="priority", max_num_seqs=8, max_num_batched_tokens=64,
                             num_blocks=9, block_size=4)                         # 8 usable blocks
    running = [Request(f"low{i}", [11 + i] * 8, priority=5, arrival_time=float(i),
                       sampling=SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(3)]
    for r in running:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                                     # 3 x 2 blocks: 2 left
    high = Request("high", [7] * 20, priority=0, arrival_time=9.0, sampling=SamplingParams(max_tokens=2))
    sched.add_request(high)
    victims = policy.victims_for_waiting(high, sched.running, sched.kv, 8, sched.watermark_blocks, 64)
    assert victims == [running[2], running[1]]       # 5 blocks for 20 tokens: 2 free + 2 from each victim
    assert sched.num_running == 3 and sched.kv.num_free_blocks == 2                 # asking changed nothing
    plan = step(sched, worker, run)
    assert plan.preempted_handles == [running[2].handle, running[1].handle] and not plan.new_requests
    run_until_idle(sched, worker, run)
    assert run.finish["high"] == RequestStatus.FINISHED_LENGTH


def test_kv_manager_and_config_must_agree_on_prefix_caching():
    config = SchedulerConfig(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching=True but the scheduler config has False"):
        Scheduler(config, KVCacheManager(16, 4), 64)
    assert not Scheduler(config, KVCacheManager(16, 4, enable_prefix_caching=False), 64).kv.enable_prefix_caching


def test_fcfs_preempts_the_latest_arrival_and_resumes_it_first():
    sched = create_scheduler(max_num_batched_tokens=16, num_blocks=7, block_size=4)    # 6 usable blocks
    a, b = create_requests(2, prompt_len=8, max_tokens=12, ignore_eos=True)
    c = Request("c", [11] * 3, arrival_time=5.0, sampling=SamplingParams(max_tokens=1))
    for r in (a, b):
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    while not any(p.preempted_handles for p in run.plans):
        step(sched, worker, run)
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    sched.add_request(c)
    assert sched.waiting.peek() is b                            # preempted requests go first
    run_until_idle(sched, worker, run)


def test_watermark_holds_back_admissions_but_not_growth():
    sched = create_scheduler(max_num_batched_tokens=64, num_blocks=13, block_size=4, admission_watermark=0.2,
                             enable_prefix_caching=False)      # 12 usable blocks, 2 kept free
    assert sched.watermark_blocks == 2
    a, b = create_requests(2, prompt_len=[16, 24], max_tokens=20, ignore_eos=True)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                   # a alone may take anything: 4 blocks
    sched.add_request(b)
    plan = step(sched, worker, run)                            # b needs 6 (+ a's 5th): 12 - 5 - 6 = 1 < 2
    assert not plan.new_requests and sched.kv.num_free_blocks == 7
    run_until_idle(sched, worker, run)
    assert run.tokens[b.request_id] == expected_output(b)[0]


# ---------------------------------------------------------------------------------------------- async
def test_async_schedules_one_token_ahead():
    sched = create_scheduler(async_scheduling=True)
    (req,) = create_requests(1, prompt_len=5, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    p0 = sched.schedule()
    assert req.num_output_placeholders == 1 and p0.num_scheduled_tokens == [5]
    p1 = sched.schedule()                                      # before p0's result: the placeholder's token
    assert p1.scheduled_handles == [req.handle] and p1.num_scheduled_tokens == [1]
    assert req.num_output_placeholders == 2 and req.num_computed_tokens == 6
    p2 = sched.schedule()                                      # 0 outputs + 2 placeholders, max 3: one more
    assert p2.num_scheduled_tokens == [1]
    assert not sched.schedule().scheduled_handles              # the third token is already in flight


def test_async_run_equals_sync_run_and_drops_tokens_after_a_stop():
    reqs = create_requests(6, prompt_len=[3, 9, 17, 4, 30, 6], max_tokens=9)
    expected = {r.request_id: expected_output(r, model=loopy_model) for r in reqs}
    sched = create_scheduler(async_scheduling=True, max_num_batched_tokens=16, num_blocks=20)
    for r in reqs:
        sched.add_request(r)
    run = run_until_idle(sched, FakeWorker(model=loopy_model))
    assert {rid: (run.tokens[rid], run.finish[rid]) for rid in expected} == expected
    assert any(p.scheduled_handles for p in run.plans[1:])


def test_async_preempt_all_resets_placeholders_and_ignores_the_stale_result():
    sched = create_scheduler(async_scheduling=True, num_speculative_tokens=2)
    reqs = create_requests(2, prompt_len=6, max_tokens=10, ignore_eos=True)
    for r in reqs:
        sched.add_request(r)
    driver = AsyncDriver(sched, FakeWorker())
    for _ in range(3):
        driver.step()
    sched.preempt_all()
    assert all(r.num_output_placeholders == 0 and not r.spec_token_ids for r in reqs)
    assert not sched.kv.pool.block_hash and sched.kv.prefix_cache_stats.resets == 1
    driver.flush()                                             # the lost worker's result: ignored
    driver.worker = FakeWorker()
    while driver.busy():
        driver.step()
    assert_idle(sched)
    assert all(driver.run.tokens[r.request_id] == expected_output(r)[0] for r in reqs)


# ---------------------------------------------------------------------------------------------- speculation
def test_ngram_proposer():
    p = NgramProposer(3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]      # longest suffix (3) matched
    assert p.propose([5, 1, 2, 7, 1, 2]) == [7, 1, 2]
    assert p.propose([1, 2, 3, 4]) == []                       # no earlier occurrence
    assert p.propose([4, 8, 4, 9, 4]) == [9, 4]                # most recent occurrence of [4]
    assert p.propose([1, 2, 3, 1, 2], max_drafts=1) == [3]
    assert p.propose([7, 7, 7]) == [7]                         # overlapping occurrence
    assert NgramProposer(2, min_n=2, max_n=2).propose([3, 1, 5, 1]) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_spec_decode_gives_identical_tokens_and_counts_acceptance(async_scheduling):
    reqs = create_requests(4, prompt_len=[5, 12, 3, 20], max_tokens=30, ignore_eos=True)
    expected = {r.request_id: expected_output(r, model=loopy_model)[0] for r in reqs}
    sched = create_scheduler(num_speculative_tokens=3, async_scheduling=async_scheduling, max_model_len=60)
    for r in reqs:
        sched.add_request(r)
    run = run_until_idle(sched, FakeWorker(model=loopy_model))
    assert run.tokens == expected
    assert sched.stats.num_draft_tokens > 0 and 0 < sched.stats.num_accepted_tokens <= sched.stats.num_draft_tokens
    assert any(p.draft_token_ids for p in run.plans)


def test_drafts_never_pass_max_tokens():
    sched = create_scheduler(num_speculative_tokens=4)
    req = Request("r", [11, 12, 11, 12, 11, 12, 11], sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(req)
    run = run_until_idle(sched, FakeWorker(model=lambda t: 12 if t[-1] == 11 else 11))
    assert run.tokens["r"] == [12, 11, 12]
    assert all(len(d) <= 2 for p in run.plans for d in p.draft_token_ids.values())


# ---------------------------------------------------------------------------------------------- config
def test_new_flags():
    parser = argparse.ArgumentParser()
    SchedulerConfig.add_cli_args(parser)
    c = SchedulerConfig.from_args(parser.parse_args(
        ["--no-enable-prefix-caching", "--scheduling-policy", "priority", "--no-async-scheduling",
         "--speculative-ngram", "3", "--admission-watermark", "0.05"]))
    assert (c.enable_prefix_caching, c.scheduling_policy, c.async_scheduling, c.num_speculative_tokens,
            c.admission_watermark) == (False, "priority", False, 3, 0.05)
    d = SchedulerConfig()
    assert (d.enable_prefix_caching, d.async_scheduling, d.scheduling_policy) == (True, True, "fcfs")
