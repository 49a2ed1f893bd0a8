"""Scheduler behaviour through its public API, with a fake worker and invariants checked after every step."""

from __future__ import annotations

import pytest
from sched_factories import (
    EOS,
    FakeWorker,
    Run,
    assert_idle,
    create_requests,
    create_scheduler,
    expected_output,
    run_until_idle,
    step,
)

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepResult
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


def test_chunked_prefill_of_a_long_prompt_with_budget_16():
    sched = create_scheduler(max_num_batched_tokens=16)
    (req,) = create_requests(1, prompt_len=50, max_tokens=3)
    sched.add_request(req)
    worker, run = FakeWorker(), Run()
    chunks = [step(sched, worker, run).num_scheduled_tokens for _ in range(4)]
    assert chunks == [[16], [16], [16], [2]]
    assert run.tokens[req.request_id] == expected_output(req)[0][:1]     # first token after the last chunk
    run_until_idle(sched, worker, run)
    assert run.tokens[req.request_id] == expected_output(req)[0]
    assert run.finish[req.request_id] == RequestStatus.FINISHED_LENGTH


def test_long_prefill_threshold_clips_each_request():
    sched = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    for r in create_requests(2, prompt_len=25, max_tokens=2):
        sched.add_request(r)
    plan = step(sched, FakeWorker(), Run())
    assert plan.num_scheduled_tokens == [10, 10]


def test_decodes_are_served_before_waiting_prompts():
    sched = create_scheduler(max_num_batched_tokens=20)
    a, b = create_requests(2, prompt_len=4, max_tokens=50, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                  # both prompts in one step
    (late,) = create_requests(1, prompt_len=100, prefix="late")
    sched.add_request(late)
    plan = step(sched, worker, run)
    assert plan.scheduled_handles == [a.handle, b.handle, late.handle]
    assert plan.num_scheduled_tokens == [1, 1, 18]            # decodes first, the prompt gets what is left
    assert [n.handle for n in plan.new_requests] == [late.handle]


@pytest.mark.parametrize("case", ["eos", "stop_id", "max_tokens", "min_tokens", "ignore_eos"])
def test_stop_conditions(case):
    script = [11, EOS, 12, 77, 13, 14, 15, 16]                # the model's outputs, in order
    params = {"eos": {}, "stop_id": {"stop_token_ids": (77,)}, "max_tokens": {"max_tokens": 1},
              "min_tokens": {"min_tokens": 3, "stop_token_ids": (77,)}, "ignore_eos": {"ignore_eos": True}}[case]
    expected = {"eos": ([11, EOS], "S"), "stop_id": ([11, EOS], "S"), "max_tokens": ([11], "L"),
                "min_tokens": ([11, EOS, 12, 77], "S"), "ignore_eos": (script[:6], "L")}[case]
    sched = create_scheduler()
    sampling = SamplingParams(**{"max_tokens": 6, **params})
    if case == "stop_id":
        sampling = SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(77,))
        expected = ([11, EOS, 12, 77], "S")
    req = Request("r", [5, 6, 7], sampling=sampling)
    sched.add_request(req)
    worker = FakeWorker(model=lambda toks: script[len(toks) - 3])
    run = run_until_idle(sched, worker)
    tokens, reason = expected
    assert run.tokens["r"] == tokens
    status = RequestStatus.FINISHED_STOPPED if reason == "S" else RequestStatus.FINISHED_LENGTH
    assert run.finish["r"] == status
    last = run.outputs["r"][-1]
    assert last.stop_token_id == (tokens[-1] if reason == "S" else None)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, len(tokens))


def test_stops_at_max_model_len():
    sched = create_scheduler(max_model_len=20)
    (req,) = create_requests(1, prompt_len=15, max_tokens=None, ignore_eos=True)   # unset: what fits
    sched.add_request(req)
    run = run_until_idle(sched, FakeWorker())
    assert len(run.tokens[req.request_id]) == 5 and run.finish[req.request_id] == RequestStatus.FINISHED_LENGTH


def test_tokens_after_a_stop_are_truncated_and_rejected_drafts_rolled_back():
    sched = create_scheduler()
    req = Request("r", [5, 6, 7, 8], sampling=SamplingParams(max_tokens=10))
    sched.add_request(req)
    worker, run = FakeWorker(model=lambda toks: 20), Run()
    step(sched, worker, run)                                  # prompt -> token 20
    req.spec_token_ids = [30, 31, 32]                         # a proposer's drafts
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == [4] and plan.draft_token_ids == {req.handle: [30, 31, 32]}
    assert req.num_computed_tokens == 8
    # 1 draft accepted, then a bonus token: 2 tokens, so 2 drafts were rejected.
    sched.update_from_output(plan, StepResult(plan.step_id, sampled={req.handle: [30, 40]}))
    assert req.output_token_ids == [20, 30, 40] and req.num_computed_tokens == 6
    req.spec_token_ids = [50, 51]
    plan = sched.schedule()
    outs = sched.update_from_output(plan, StepResult(plan.step_id, sampled={req.handle: [50, EOS, 99]}))
    assert outs[0].new_token_ids == [50, EOS] and outs[0].finish_reason == RequestStatus.FINISHED_STOPPED
    assert_idle(sched)


def test_aborts_leak_nothing():
    sched = create_scheduler(max_num_batched_tokens=16, num_blocks=64)
    running, mid_prompt, waiting = create_requests(3, prompt_len=[4, 40, 8], max_tokens=50, ignore_eos=True)
    for r in (running, mid_prompt, waiting):
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    plan = step(sched, worker, run)
    assert plan.num_scheduled_tokens == [4, 12] and sched.num_waiting == 1
    step(sched, worker, run)                                  # running decodes, mid_prompt still in its prompt
    assert 0 < mid_prompt.num_computed_tokens < 40
    outs = sched.abort_requests([waiting.request_id, mid_prompt.request_id, running.request_id, "unknown"])
    assert [o.finish_reason for o in outs] == [RequestStatus.FINISHED_ABORTED] * 3
    assert_idle(sched)
    plan = step(sched, worker, run)                           # the worker hears only of what it held
    assert sorted(plan.finished_handles) == sorted([mid_prompt.handle, running.handle])
    assert not worker.held


def test_step_error_fails_the_plans_requests_and_frees_blocks():
    sched = create_scheduler()
    a, b = create_requests(2, prompt_len=6, max_tokens=5, ignore_eos=True)
    sched.add_request(a)
    worker, run = FakeWorker(fail_steps={1}), Run()
    step(sched, worker, run)
    sched.add_request(b)                                      # b joins at step 1 too
    step(sched, worker, run)
    for r in (a, b):
        assert run.finish[r.request_id] == RequestStatus.FINISHED_ERROR
        assert "illegal memory access" in run.outputs[r.request_id][-1].error
    assert_idle(sched)
    assert sorted(sched.schedule().finished_handles) == sorted([a.handle, b.handle])


def test_plan_deltas_send_only_new_blocks():
    sched = create_scheduler(block_size=4)
    (req,) = create_requests(1, prompt_len=6, max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    worker, run = FakeWorker(block_size=4), Run()
    plan = step(sched, worker, run)
    assert [n.block_ids for n in plan.new_requests] == [sched.kv.get_block_ids(req)]
    assert len(plan.new_requests[0].block_ids) == 2
    new_blocks = [step(sched, worker, run).cached.new_block_ids for _ in range(4)]
    # 6, 7, 8, 9 tokens computed before each step: only the step that writes the 9th token needs a new block,
    # and only then is the request listed at all (the worker derives num_computed_tokens from its own steps).
    assert new_blocks == [[], [], [[sched.kv.get_block_ids(req)[2]]], []]
    assert all(not p.new_requests for p in run.plans[1:])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_tiny_pool_matches_a_huge_pool(prefix_caching):
    reqs = create_requests(6, prompt_len=[9, 14, 5, 11, 7, 13], max_tokens=12, ignore_eos=True)
    expected = {r.request_id: expected_output(r)[0] for r in reqs}
    sched = create_scheduler(max_num_batched_tokens=16, num_blocks=10, block_size=4,    # 9 usable blocks
                             enable_prefix_caching=prefix_caching)
    for r in reqs:
        sched.add_request(r)
    run = run_until_idle(sched, FakeWorker(block_size=4))
    assert run.tokens == expected
    assert sum(r.num_preemptions for r in reqs) > 0
    assert any(p.preempted_handles for p in run.plans)
    resumed = [n for p in run.plans for n in p.new_requests if n.output_token_ids]
    assert resumed
    if not prefix_caching:                                     # recompute: prompt + outputs again
        assert all(n.num_computed_tokens == 0 for n in resumed)


def test_preempt_all_then_resume_on_a_new_worker():
    reqs = create_requests(3, prompt_len=10, max_tokens=8, ignore_eos=True)
    sched = create_scheduler(max_num_batched_tokens=16)
    for r in reqs:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    for _ in range(3):
        step(sched, worker, run)
    in_flight = sched.schedule()                               # sent to the worker that then dies
    stale = worker.execute(in_flight)
    sched.preempt_all()
    assert sched.num_running == 0 and sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in reqs)
    assert sched.update_from_output(in_flight, stale) == []    # results of the lost worker are ignored
    new_worker = FakeWorker()
    plan = step(sched, new_worker, run)
    assert not plan.finished_handles and not plan.preempted_handles
    run_until_idle(sched, new_worker, run)
    assert run.tokens == {r.request_id: expected_output(r)[0] for r in reqs}


def test_max_num_seqs_limits_admission():
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(5, prompt_len=3, max_tokens=4, ignore_eos=True):
        sched.add_request(r)
    step(sched, FakeWorker(), Run())
    assert sched.num_running == 2 and sched.num_waiting == 3


def test_rejects_requests_that_can_never_run():
    sched = create_scheduler(max_model_len=32, num_blocks=5, block_size=4)   # 16 tokens of KV
    with pytest.raises(RequestRejectedError, match="context length is 32") as err:
        sched.add_request(Request("long", list(range(10, 42))))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejectedError, match="lower max_tokens") as err:
        sched.add_request(Request("big", list(range(10, 20)), sampling=SamplingParams(max_tokens=10)))
    assert err.value.code == "kv_cache_too_small"
    sched.add_request(Request("ok", list(range(10, 20)), sampling=SamplingParams(max_tokens=7)))  # 16 KV tokens
    with pytest.raises(ValueError):
        sched.add_request(Request("ok", [11]))
    run_until_idle(sched, FakeWorker())


def test_handles_are_small_and_not_reused_in_the_plan_that_drops_them():
    sched = create_scheduler()
    (a,) = create_requests(1, prompt_len=3, max_tokens=1)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)                                   # a finishes after one token
    (b,) = create_requests(1, prefix="b")
    sched.add_request(b)
    plan = step(sched, worker, run)
    assert plan.finished_handles == [a.handle] and b.handle != a.handle
    (c,) = create_requests(1, prefix="c")
    sched.add_request(c)
    assert c.handle == a.handle                                # recycled once the worker dropped it


def test_drain_requests_for_a_new_scheduler():
    reqs = create_requests(3, prompt_len=10, max_tokens=6, ignore_eos=True)
    sched = create_scheduler(max_num_batched_tokens=16)
    for r in reqs:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    step(sched, worker, run)
    drained = sched.drain_requests()
    assert {r.request_id for r in drained} == {r.request_id for r in reqs}
    assert_idle(sched)
    bigger = create_scheduler(num_blocks=50)
    for r in drained:
        bigger.add_request(r)
    run_until_idle(bigger, FakeWorker(), run)
    assert run.tokens == {r.request_id: expected_output(r)[0] for r in reqs}
