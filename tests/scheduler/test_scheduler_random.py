"""Randomized runs: random requests, budgets, pools, aborts, step errors and worker losses.

After every step the invariants hold (see sched_factories.step); at the end nothing leaks, and every request that
was neither aborted nor failed produced exactly what it produces alone (results do not depend on the schedule).
"""

from __future__ import annotations

import random

import pytest
from sched_factories import (
    EOS,
    FakeWorker,
    Run,
    assert_idle,
    create_scheduler,
    expected_output,
    fake_model,
    step,
)

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


def chatty_model(tokens: list[int]) -> int:
    """Emits EOS now and then and draws from a small vocabulary, so stop ids are hit too."""
    t = fake_model(tokens)
    return EOS if t % 13 == 0 else 10 + t % 30


def random_request(rng: random.Random, i: int) -> Request:
    sampling = SamplingParams(max_tokens=rng.randint(1, 40), min_tokens=rng.choice([0, 0, 3]),
                              ignore_eos=rng.random() < 0.2,
                              stop_token_ids=tuple(rng.sample(range(10, 40), rng.choice([0, 0, 1, 2]))))
    prompt = [rng.randrange(10, 40) for _ in range(rng.choice([1, 3, 8, 20, 70, 150]))]
    return Request(f"r{i}", prompt, sampling=sampling, priority=rng.choice([0, 0, 1]), arrival_time=float(i))


def random_scheduler(rng: random.Random):
    max_seqs = rng.choice([1, 2, 4, 16])
    return create_scheduler(max_num_batched_tokens=rng.choice([max_seqs, 8, 16, 64, 512]) if max_seqs <= 8 else 64,
                            max_num_seqs=max_seqs, long_prefill_token_threshold=rng.choice([0, 0, 5, 32]),
                            num_blocks=rng.choice([12, 30, 60, 200]), block_size=rng.choice([1, 4, 16]),
                            max_model_len=rng.choice([64, 128, 4096]))


@pytest.mark.parametrize("seed", range(60))
def test_random_workload(seed):
    rng = random.Random(seed)
    sched = random_scheduler(rng)
    worker, run = FakeWorker(block_size=sched.kv.block_size, model=chatty_model), Run()
    accepted, broken, next_id = {}, set(), 0
    while next_id < 40 or sched.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 0, 1, 3])) if next_id < 40 else ():
            req, next_id = random_request(rng, next_id), next_id + 1
            if try_add(sched, req):
                accepted[req.request_id] = req
        if rng.random() < 0.05 and sched.has_unfinished_requests():
            live = [r.request_id for r in list(sched.running) + list(sched.waiting)]
            victims = rng.sample(live, rng.randint(1, min(3, len(live))))
            run.collect(sched.abort_requests(victims))
            broken.update(victims)
        if rng.random() < 0.02:
            sched.preempt_all()                            # worker lost; a fresh one attaches
            worker = FakeWorker(block_size=sched.kv.block_size, model=chatty_model)
        worker.fail_steps = {sched._next_step_id} if rng.random() < 0.02 else set()
        step(sched, worker, run)
        broken.update(rid for rid, s in run.finish.items() if s == RequestStatus.FINISHED_ERROR)
        assert run.steps < 50_000
    assert_idle(sched)
    assert set(run.finish) == set(accepted)
    for rid, req in accepted.items():
        want, reason = expected_output(req, sched.max_model_len, model=chatty_model)
        got = run.tokens.get(rid, [])
        if rid in broken:
            assert got == want[:len(got)]
        else:
            assert (got, run.finish[rid]) == (want, reason), rid
            assert req.output_token_ids == want


def try_add(sched, req: Request) -> bool:
    final_len = req.num_prompt_tokens + req.sampling.max_tokens   # must fit the context (request_outputs.py)
    legit = (final_len <= sched.max_model_len and req.sampling.min_tokens <= req.sampling.max_tokens
             and sched.kv.can_fit(final_len - 1))
    try:
        sched.add_request(req)
    except RequestRejectedError:
        assert not legit, f"{req.request_id} rejected but could run"
        return False
    assert legit, f"{req.request_id} accepted but can never run"
    return True
