"""A migrated request (GenerateRequest.resume_output_token_ids) enters the scheduler with outputs already
delivered: they go to the worker as outputs (as a preempted request's do), max_tokens and min_tokens count them,
its chunks carry only the tokens after them, and it continues exactly where an undisturbed run would."""

from __future__ import annotations

import dataclasses

import pytest
from sched_factories import (
    EOS,
    FakeWorker,
    Run,
    create_requests,
    create_scheduler,
    expected_output,
    run_until_idle,
)

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


def resumed(request: Request, delivered: list[int], request_id: str = "resumed") -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(request.prompt_token_ids),
                   sampling=request.sampling, output_token_ids=list(delivered))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 5, 11])
def test_a_resumed_request_continues_the_undisturbed_output(async_scheduling, k):
    (original,) = create_requests(1, prompt_len=9, max_tokens=12, ignore_eos=True)
    full, status = expected_output(original)
    sched = create_scheduler(max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=async_scheduling)
    request = resumed(original, full[:k])
    sched.add_request(request)
    run = run_until_idle(sched, FakeWorker(), Run())
    assert run.tokens["resumed"] == full[k:]               # only what comes after the delivered tokens
    assert run.finish["resumed"] == status == RequestStatus.FINISHED_LENGTH
    last = run.outputs["resumed"][-1]
    assert (last.num_prompt_tokens, last.num_output_tokens) == (9, 12)   # usage: the prompt is the original one
    first_new = next(new for plan in run.plans for new in plan.new_requests)
    assert first_new.output_token_ids == full[:k]          # the worker sees them as outputs, not prompt
    assert first_new.prompt_token_ids == original.prompt_token_ids


def test_min_tokens_counts_the_delivered_tokens():
    """The model says EOS from its 3rd output on; min_tokens 6 holds it back until output 6 in all. Resumed after
    4, it gives 2 more, not 6 more."""
    def eos_after_two(tokens: list[int]) -> int:
        return EOS if len(tokens) - 9 >= 2 else 50 + len(tokens)

    (original,) = create_requests(1, prompt_len=9, max_tokens=20, min_tokens=6)
    full, status = expected_output(original, model=eos_after_two)
    assert len(full) == 6 and status == RequestStatus.FINISHED_STOPPED
    sched = create_scheduler()
    sched.add_request(resumed(original, full[:4]))
    run = run_until_idle(sched, FakeWorker(model=eos_after_two), Run())
    assert run.tokens["resumed"] == full[4:] and run.finish["resumed"] == RequestStatus.FINISHED_STOPPED


def test_a_stop_token_among_the_delivered_ones_does_not_stop_it():
    """Delivered tokens were already checked by the engine that sampled them (an EOS before min_tokens, say)."""
    (original,) = create_requests(1, prompt_len=6, max_tokens=8)
    full, _ = expected_output(original)
    delivered = [EOS, *full[1:3]]
    expected = expected_output(dataclasses.replace(original, prompt_token_ids=original.prompt_token_ids + delivered,
                                                   sampling=SamplingParams(max_tokens=5)))[0]
    sched = create_scheduler()
    sched.add_request(resumed(original, delivered))
    run = run_until_idle(sched, FakeWorker(), Run())
    assert run.tokens["resumed"] == expected


def test_nothing_left_to_generate_or_prompt_logprobs_is_refused():
    (original,) = create_requests(1, prompt_len=6, max_tokens=4)
    sched = create_scheduler()
    with pytest.raises(RequestRejectedError) as info:
        sched.add_request(resumed(original, [11, 12, 13, 14]))
    assert info.value.param == "resume_output_token_ids" and "max_tokens (4)" in str(info.value)
    logprobs = Request(request_id="lp", prompt_token_ids=[11] * 6, output_token_ids=[12],
                       sampling=SamplingParams(max_tokens=4, prompt_logprobs=0))
    with pytest.raises(RequestRejectedError) as info:
        sched.add_request(logprobs)
    assert info.value.param == "prompt_logprobs"
    sched.add_request(resumed(original, [11, 12, 13]))     # one left: fine
    assert run_until_idle(sched, FakeWorker(), Run()).tokens["resumed"] == expected_output(
        dataclasses.replace(original, prompt_token_ids=original.prompt_token_ids + [11, 12, 13]))[0][:1]
