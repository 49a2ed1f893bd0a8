"""Random workloads with KV tiers below the pool (host, disk) on and off: multi-turn returns and shared prefixes over
tiny pools (so blocks are demoted, restored and preempted requests swap), aborts, failed steps, lost workers (the
disk survives them, the host tier does not), corrupt files and a full disk.

The worker keeps KV contents and checks every attended position before each forward (tiered_fake_worker.py); the
scheduler's invariants, tiers included, hold after every step, every plan's moves are in a safe order, every
request that was neither aborted nor failed produces exactly what it produces alone, the same with tiers on and
off, and at the end no pool block is held and every tier's accounting matches what the worker holds.
"""

from __future__ import annotations

import random

import pytest
from sched_factories import EOS, Run, check_plan, create_scheduler, expected_output, fake_model, gaps
from tiered_fake_worker import TieredFakeWorker

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_tiers import KvTiers, check_move_order
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


def chatty_model(tokens: list[int]) -> int:
    t = fake_model(tokens)
    return EOS if t % 17 == 0 else 10 + t % 30


def workload(rng: random.Random, n: int, block_size: int) -> list[tuple[int, Request]]:
    """(arrival step, request): conversations whose later turns resend the earlier ones plus new tokens."""
    convs: list[list[int]] = []
    out, at = [], 0
    for i in range(n):
        at += rng.choice([0, 0, 1, 2, 5])
        if convs and rng.random() < 0.6:
            prompt = rng.choice(convs) + [rng.randrange(10, 40) for _ in range(rng.choice([1, 3, block_size * 2]))]
        else:
            prompt = [rng.randrange(10, 40) for _ in range(rng.choice([3, 9, 20, 40]))]
        convs.append(prompt)
        sampling = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3)
        out.append((at, Request(f"r{i}", prompt, sampling=sampling, arrival_time=float(i),
                                priority=rng.choice([0, 0, 1]))))
    return out


def attach(sched, worker: TieredFakeWorker, host: int, disk: int) -> None:
    sched.kv.attach_tiers(KvTiers(host, disk, 64, list(worker.disk)) if host else None)


def run_workload(seed: int, tiers_on: bool):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    async_ = rng.random() < 0.5
    sched = create_scheduler(max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=rng.choice([1, 2, 4]),
                             num_blocks=rng.choice([24, 40, 80]) // block_size + 1, block_size=block_size,
                             max_model_len=128, async_scheduling=async_,
                             long_prefill_token_threshold=rng.choice([0, 0, 8]),
                             scheduling_policy=rng.choice(["fcfs", "priority"]))
    host, disk = rng.choice([2, 8, 40]), rng.choice([0, 0, 6, 100])
    worker = TieredFakeWorker(block_size=block_size, model=chatty_model)
    if tiers_on:
        attach(sched, worker, host, disk)
    events = random.Random(seed * 7 + 1)       # faults: the same with tiers on and off
    arrivals = workload(rng, 30, block_size)
    run, accepted, broken, step_no, pending = Run(), {}, set(), 0, None
    while arrivals or sched.has_unfinished_requests() or pending is not None:
        while arrivals and arrivals[0][0] <= step_no:
            req = arrivals.pop(0)[1]
            try:
                sched.add_request(req)
                accepted[req.request_id] = req
            except RequestRejectedError:
                pass
        if events.random() < 0.03 and sched.has_unfinished_requests():
            live = [r.request_id for r in list(sched.running) + list(sched.waiting)]
            victims = events.sample(live, 1)
            run.collect(sched.abort_requests(victims))
            broken.update(victims)
        if events.random() < 0.01:                 # worker lost: a new one, same disk, empty memory
            sched.preempt_all()
            pending = None
            worker = TieredFakeWorker(block_size=block_size, model=chatty_model, disk=worker.disk,
                                      corrupt=worker.corrupt)
            if tiers_on:
                attach(sched, worker, host, disk)
        corrupt, full = events.random() < 0.05, events.random() < 0.05
        if tiers_on and worker.disk and corrupt:
            worker.corrupt.add(min(worker.disk))
        worker.disk_full = tiers_on and full
        worker.fail_steps = {sched._next_step_id} if events.random() < 0.01 else set()
        before = gaps(sched)
        plan = sched.schedule()
        check_plan(sched, plan, before)
        check_move_order(plan.kv_moves)
        result = worker.execute(plan)
        if async_:                                 # one plan in flight: apply N after scheduling N+1
            if pending is not None:
                run.collect(sched.update_from_output(*pending))
                sched.check_integrity()
            pending = (plan, result) if plan.scheduled_handles or plan.kv_moves else None
        else:
            run.collect(sched.update_from_output(plan, result))
            sched.check_integrity()
        broken.update(rid for rid, s in run.finish.items() if s == RequestStatus.FINISHED_ERROR)
        step_no += 1
        assert step_no < 20_000, "no progress"
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks, "pool blocks leaked"
    sched.check_integrity()
    tiers = sched.kv.tiers
    if tiers is not None:
        for slot in tiers.host.entries.values():
            assert slot in worker.host, f"host slot {slot} accounted but never written"
        if tiers.disk is not None:
            assert set(tiers.disk.entries) == set(worker.disk) - set(tiers.moves.disk_drops), "disk index drifted"
    for rid, req in accepted.items():
        want, reason = expected_output(req, sched.max_model_len, model=chatty_model)
        got = run.tokens.get(rid, [])
        if rid in broken:
            assert got == want[:len(got)], rid
        else:
            assert (got, run.finish[rid]) == (want, reason), rid
    return run, broken, tiers, sched.num_preemptions


@pytest.mark.parametrize("seed", range(40))
def test_tiers_on_off_same_tokens(seed):
    off, broken_off, _, _ = run_workload(seed, tiers_on=False)
    on, broken_on, _, _ = run_workload(seed, tiers_on=True)
    for rid in set(off.finish) - broken_off - broken_on:
        assert on.tokens.get(rid) == off.tokens.get(rid), rid


def test_fuzz_exercises_every_move():
    """The workloads above do demote, restore, promote, miss and preempt (else the fuzz proves little)."""
    stats = {"stores": 0, "loads": 0, "promotes": 0, "misses": 0, "preemptions": 0, "demotes": 0}
    for seed in range(40):
        run, _, tiers, preemptions = run_workload(seed, tiers_on=True)
        stats["preemptions"] += preemptions
        for plan in run.plans if run.plans else ():
            pass
        stats["stores"] += tiers.stats["CPU"].blocks_in
        stats["loads"] += tiers.stats["CPU"].hits
        stats["promotes"] += tiers.stats["DISK"].blocks_out
        stats["demotes"] += tiers.stats["DISK"].blocks_in
        stats["misses"] += tiers.stats["DISK"].misses
    assert all(v > 0 for v in stats.values()), stats
