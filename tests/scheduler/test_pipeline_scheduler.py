"""PipelineScheduler (-pp N): up to N plans in flight, one per stage, with disjoint batches.

A fake pipeline stands in for the stages: the first stage runs a plan when it is sent (it holds only the tokens the
plans gave it: new requests in full, then StepPlan.stage_token_*), the last stage (a FakeWorker, which samples)
when its result is awaited, so the first stage is always up to N - 1 plans ahead, as on real stages. Outputs must
equal what the fake model gives without any scheduler, under chunked prefill, preemption and aborts; every plan is
checked against the DESIGN.md invariants and the scheduler's integrity after every step.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.async_scheduler import make_scheduler, plans_in_flight
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.pipeline_scheduler import PipelineScheduler
from tests.scheduler.sched_factories import (
    EOS,
    FakeWorker,
    Run,
    assert_idle,
    check_plan,
    create_requests,
    expected_output,
    gaps,
)


@dataclass
class FirstStage:
    """What a stage before the last holds of each request: its tokens, from plans only."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    computed: dict[int, int] = field(default_factory=dict)

    def execute(self, plan: StepPlan) -> None:
        for handle in plan.finished_handles + plan.preempted_handles:
            self.tokens.pop(handle)
        for handle, token in zip(plan.stage_token_handles, plan.stage_token_ids):
            self.tokens[handle].append(token)
        for new in plan.new_requests:
            self.tokens[new.handle] = new.prompt_token_ids + new.output_token_ids
            self.computed[new.handle] = new.num_computed_tokens
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            end = self.computed[handle] + n
            assert end <= len(self.tokens[handle]), f"step {plan.step_id}: handle {handle}'s input is not here yet"
            self.computed[handle] = end


@dataclass
class PipelineDriver:
    """The engine loop's window: send while fewer than `window` plans are out, else apply the oldest result."""

    sched: PipelineScheduler
    window: int
    first: FirstStage = field(default_factory=FirstStage)
    last: FakeWorker = field(default_factory=FakeWorker)
    run: Run = field(default_factory=Run)
    out: deque = field(default_factory=deque)
    full_steps: int = 0                  # steps sent with `window` plans then in flight (every stage busy)

    def step(self) -> None:
        sent = False
        if len(self.out) < self.window and self.sched.has_unfinished_requests():
            before = gaps(self.sched)
            plan = self.sched.schedule()
            check_plan(self.sched, plan, before)
            if plan.scheduled_handles or plan.finished_handles or plan.preempted_handles:
                in_flight = {h for p in self.out for h in p.scheduled_handles}
                assert not in_flight & set(plan.scheduled_handles), "a request has two steps in flight"
                self.first.execute(plan)
                self.out.append(plan)
                self.run.plans.append(plan)
                self.full_steps += len(self.out) == self.window
                sent = True
        if self.out and (len(self.out) == self.window or not sent):
            plan = self.out.popleft()
            result: StepResult = self.last.execute(plan)
            self.run.collect(self.sched.update_from_output(plan, result))
            self.sched.check_integrity()
        self.run.steps += 1

    def until_idle(self, max_steps: int = 20_000) -> Run:
        while self.sched.has_unfinished_requests() or self.out:
            self.step()
            assert self.run.steps < max_steps, "no progress"
        assert_idle(self.sched)
        return self.run


def create_pipeline(num_blocks: int = 1000, max_num_batched_tokens: int = 64, pp: int = 2, **config):
    cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=min(16, max_num_batched_tokens), **config)
    sched = make_scheduler(cfg, KVCacheManager(num_blocks, 4, cfg.enable_prefix_caching), 1024, (EOS,),
                           pipeline_parallel_size=pp)
    assert isinstance(sched, PipelineScheduler) and plans_in_flight(cfg, pp) == pp
    return sched


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("num_blocks, budget, threshold", [(1000, 64, 0), (1000, 24, 5), (40, 32, 0)],
                         ids=["whole-prompts", "chunked", "preempting"])
def test_outputs_equal_the_model_with_one_plan_per_stage_in_flight(pp, num_blocks, budget, threshold):
    sched = create_pipeline(num_blocks, budget, pp, long_prefill_token_threshold=threshold,
                            enable_prefix_caching=True)
    requests = create_requests(12, prompt_len=[5, 17, 9, 30, 3, 12, 21, 8, 14, 6, 25, 11], max_tokens=12, seed=3)
    for r in requests:
        sched.add_request(r)
    driver = PipelineDriver(sched, pp)
    run = driver.until_idle()
    for r in requests:
        want, status = expected_output(r)
        assert run.tokens[r.request_id] == want, r.request_id
        assert run.finish[r.request_id] == status
    assert driver.full_steps > run.steps // 3, "the stages did not overlap"
    if num_blocks == 40:
        assert sched.num_preemptions > 0, "the pool was meant to be too small"


@pytest.mark.parametrize("c_loops", [True, False])
def test_the_batches_balance_so_every_stage_has_work(c_loops):
    sched = create_pipeline(max_num_batched_tokens=256)
    if not c_loops:
        sched.c_loops = None
    for r in create_requests(16, prompt_len=4, max_tokens=20, ignore_eos=True):
        sched.add_request(r)
    run = PipelineDriver(sched, 2).until_idle()
    assert [len(p.scheduled_handles) for p in run.plans if p.scheduled_handles] == [8] * 40   # 16 x 20 in halves


def test_a_busy_request_is_not_scheduled_and_its_token_reaches_the_first_stage_in_its_next_plan():
    sched = create_pipeline()
    a, b = create_requests(2, prompt_len=4, max_tokens=4)
    sched.add_request(a)
    plan0 = sched.schedule()                         # a's prompt
    sched.add_request(b)
    plan1 = sched.schedule()                         # a is busy: b only
    assert plan0.scheduled_handles == [a.handle] and plan1.scheduled_handles == [b.handle]
    assert sched.schedule().scheduled_handles == []  # both busy
    sched.update_from_output(plan0, StepResult(plan0.step_id, sampled={a.handle: [77]}))
    plan3 = sched.schedule()
    assert plan3.scheduled_handles == [a.handle]
    assert (plan3.stage_token_handles, plan3.stage_token_ids) == ([a.handle], [77])
    assert not plan1.stage_token_ids                 # a new request carries its tokens itself


def test_a_request_preempted_while_busy_waits_for_its_stale_step_before_it_is_readmitted():
    sched = create_pipeline(num_blocks=5, max_num_batched_tokens=8, pp=3)    # 4 usable blocks of 4 tokens
    b, a = create_requests(2, prompt_len=7, max_tokens=8, ignore_eos=True)  # b arrived first: a is the victim
    sched.add_request(b)
    sched.add_request(a)
    plan0, plan1 = sched.schedule(), sched.schedule()      # b's prompt, then a's (2 blocks each: the pool is full)
    assert (plan0.scheduled_handles, plan1.scheduled_handles) == ([b.handle], [a.handle])
    sched.update_from_output(plan0, StepResult(plan0.step_id, sampled={b.handle: [70]}))
    plan2 = sched.schedule()                               # b's decode at position 7: still in its 2nd block
    assert plan2.scheduled_handles == [b.handle] and not plan2.preempted_handles
    sched.update_from_output(plan1, StepResult(plan1.step_id, sampled={a.handle: [71]}))
    plan3 = sched.schedule()                               # a's decode: a is busy in plan 3 now
    assert plan3.scheduled_handles == [a.handle]
    sched.update_from_output(plan2, StepResult(plan2.step_id, sampled={b.handle: [72]}))
    plan4 = sched.schedule()                               # b's decode needs a 3rd block: a, busy, goes
    assert plan4.preempted_handles == [a.handle] and plan4.scheduled_handles == [b.handle]
    plan5 = sched.schedule()                               # a heads the queue but its plan-3 step is still out
    assert not plan5.new_requests and not plan5.scheduled_handles
    assert sched.update_from_output(plan3, StepResult(plan3.step_id, sampled={a.handle: [73]})) == []
    assert a.output_token_ids == [71]                      # the stale token was dropped
    sched.update_from_output(plan4, StepResult(plan4.step_id, sampled={b.handle: [74]}))
    sched.abort_requests([b.request_id])
    plan6 = sched.schedule()
    assert [n.handle for n in plan6.new_requests] == [a.handle] and not plan6.stage_token_ids
    sched.check_integrity()


def test_the_engine_loop_keeps_one_plan_per_stage_in_flight():
    sync, asyn = SchedulerConfig(async_scheduling=False), SchedulerConfig(async_scheduling=True)
    assert [plans_in_flight(sync), plans_in_flight(asyn), plans_in_flight(asyn, 2), plans_in_flight(sync, 3)] \
        == [1, 2, 2, 3]


@pytest.mark.parametrize("seed", range(4))
def test_aborts_of_busy_and_waiting_requests_leak_nothing(seed):
    rng = random.Random(seed)
    sched = create_pipeline(num_blocks=40, max_num_batched_tokens=24, long_prefill_token_threshold=6,
                            enable_prefix_caching=True)
    requests = create_requests(12, prompt_len=[rng.randrange(3, 30) for _ in range(12)], max_tokens=10, seed=seed)
    for r in requests:
        sched.add_request(r)
    driver = PipelineDriver(sched, 2)
    aborted = set()
    while sched.has_unfinished_requests() or driver.out:
        driver.step()
        live = [r for r in requests if r.request_id in sched.requests]
        if live and rng.random() < 0.1:               # busy or not, running or waiting
            victim = rng.choice(live)
            sched.abort_requests([victim.request_id])
            aborted.add(victim.request_id)
            sched.check_integrity()
        assert driver.run.steps < 5000, "no progress"
    assert_idle(sched)
    assert aborted
    for r in requests:
        if r.request_id not in aborted:
            assert driver.run.tokens[r.request_id] == expected_output(r)[0], r.request_id


def test_beam_search_is_refused_under_pp_not_served_wrong():
    from steploop.common.beam_ranking import BeamConfig
    from steploop.common.sampling_params import SamplingParams
    from steploop.scheduler.request import Request, RequestRejectedError

    sched = create_pipeline()
    beam = Request(request_id="b", prompt_token_ids=[5, 6, 7], arrival_time=0.0,
                   sampling=SamplingParams(max_tokens=4), beam=BeamConfig(2, 1.0, False))
    with pytest.raises(RequestRejectedError, match="pipeline-parallel") as refused:
        sched.add_request(beam)
    assert refused.value.param == "use_beam_search"
    assert not sched.has_unfinished_requests()
