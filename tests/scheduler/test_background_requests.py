"""Background (Batch API) requests yield to interactive ones under every scheduling policy: interactive requests
wait in front of them, take the step's budget before their prompt chunks, and preempt them for a seat or blocks;
background requests never preempt interactive ones, and every output stays what the model alone produces."""

from __future__ import annotations

import pytest
from sched_factories import FakeWorker, Run, create_scheduler, expected_output, run_until_idle, step

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request

POLICIES = ("fcfs", "priority")


def _req(name: str, prompt_len: int, max_tokens: int, arrival: float, background: bool = False,
         priority: int = 0) -> Request:
    return Request(name, [11 + sum(map(ord, name)) % 50] * prompt_len, priority=priority, arrival_time=arrival,
                   background=background, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _check_outputs(run: Run, requests: list[Request]) -> None:
    for r in requests:
        assert run.tokens[r.request_id] == expected_output(r)[0], r.request_id


@pytest.mark.parametrize("policy", POLICIES)
def test_interactive_requests_are_admitted_before_earlier_background_ones(policy):
    sched = create_scheduler(scheduling_policy=policy, max_num_seqs=1, max_num_batched_tokens=16)
    reqs = [_req("b0", 3, 1, 0.0, background=True), _req("b1", 3, 1, 1.0, background=True), _req("i", 3, 1, 2.0)]
    for r in reqs:
        sched.add_request(r)
    run = run_until_idle(sched, FakeWorker())
    order = [sched_new.handle for p in run.plans for sched_new in p.new_requests]
    assert order == [reqs[2].handle, reqs[0].handle, reqs[1].handle]
    _check_outputs(run, reqs)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("async_scheduling", (False, True))
def test_an_interactive_arrival_preempts_a_running_background_request_for_its_seat(policy, async_scheduling):
    sched = create_scheduler(scheduling_policy=policy, max_num_seqs=1, max_num_batched_tokens=16,
                             async_scheduling=async_scheduling)
    batch = _req("batch", 4, 12, 0.0, background=True)
    sched.add_request(batch)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    interactive = _req("chat", 3, 3, 1.0)
    sched.add_request(interactive)
    plan = step(sched, worker, run)
    assert plan.preempted_handles == [batch.handle] and not plan.new_requests
    plan = step(sched, worker, run)
    assert [n.handle for n in plan.new_requests] == [interactive.handle]
    run_until_idle(sched, worker, run)
    assert batch.num_preemptions == 1
    _check_outputs(run, [batch, interactive])


@pytest.mark.parametrize("policy", POLICIES)
def test_background_never_preempts_interactive(policy):
    """A background arrival waits for the seat; it does not take it even with a better `priority` value."""
    sched = create_scheduler(scheduling_policy=policy, max_num_seqs=1, max_num_batched_tokens=16)
    chat = _req("chat", 4, 6, 0.0, priority=5)
    sched.add_request(chat)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    batch = _req("batch", 3, 2, 1.0, background=True, priority=-5)
    sched.add_request(batch)
    run_until_idle(sched, worker, run)
    assert chat.num_preemptions == 0
    first_batch_step = next(k for k, p in enumerate(run.plans) if batch.handle in [n.handle for n in p.new_requests])
    assert run.finish["chat"] and all(chat.handle not in p.scheduled_handles for p in run.plans[first_batch_step:])
    _check_outputs(run, [chat, batch])


@pytest.mark.parametrize("policy", POLICIES)
def test_background_prompt_chunks_leave_the_budget_to_a_waiting_interactive_request(policy):
    """A long background prompt in chunks of the whole budget: an interactive arrival's prompt runs in the very
    next step (the background chunk waits that step, its request keeps its blocks), then the chunks go on."""
    sched = create_scheduler(scheduling_policy=policy, max_num_seqs=4, max_num_batched_tokens=16)
    batch = _req("batch", 64, 2, 0.0, background=True)
    sched.add_request(batch)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                  # 16 of its 64 prompt tokens
    chat = _req("chat", 12, 3, 1.0)
    sched.add_request(chat)
    plan = step(sched, worker, run)
    scheduled = dict(zip(plan.scheduled_handles, plan.num_scheduled_tokens))
    assert scheduled == {chat.handle: 12} and not plan.preempted_handles
    assert batch.num_computed_tokens == 16 and batch.num_preemptions == 0
    plan = step(sched, worker, run)                           # chat decodes; the batch prompt goes on beside it
    scheduled = dict(zip(plan.scheduled_handles, plan.num_scheduled_tokens))
    assert scheduled == {chat.handle: 1, batch.handle: 15}
    run_until_idle(sched, worker, run)
    _check_outputs(run, [batch, chat])


@pytest.mark.parametrize("policy", POLICIES)
def test_an_interactive_request_preempts_background_ones_for_blocks(policy):
    sched = create_scheduler(scheduling_policy=policy, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=9,
                             block_size=4)                    # 8 usable blocks
    batch = [_req(f"b{i}", 8, 20, float(i), background=True) for i in range(3)]
    for r in batch:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                  # 3 x 2 blocks: 2 left
    chat = _req("chat", 20, 2, 9.0)
    sched.add_request(chat)
    plan = step(sched, worker, run)
    assert plan.preempted_handles == [batch[2].handle, batch[1].handle] and not plan.new_requests
    plan = step(sched, worker, run)
    assert chat.handle in [n.handle for n in plan.new_requests]
    run_until_idle(sched, worker, run)
    _check_outputs(run, [*batch, chat])
