"""Prompt logprobs in the scheduler: no prefix-cache hits for requests that ask, chunks stitched in order, and a
recomputed chunk (after preemption) does not duplicate entries."""

from __future__ import annotations

from dataclasses import replace

from steploop.common.step_contract import StepResult, TokenLogprob
from steploop.scheduler.request_outputs import add_prompt_logprobs
from tests.scheduler.sched_factories import create_requests, create_scheduler


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(-float(token))


def test_add_prompt_logprobs_stitches_chunks_and_drops_repeats():
    req = create_requests(1, prompt_len=10)[0]
    add_prompt_logprobs(req, [lp(t) for t in range(1, 5)], 0)        # chunk 0..3 -> tokens 1..4
    add_prompt_logprobs(req, [lp(t) for t in range(1, 5)], 0)        # recomputed after preemption: dropped
    add_prompt_logprobs(req, [lp(t) for t in range(5, 12)], 4)       # chunk 4.. -> tokens 5..9, extra dropped
    assert [x.logprob for x in req.prompt_logprobs] == [-float(t) for t in range(1, 10)]


def test_prompt_logprob_request_takes_no_prefix_hits_and_gets_them_with_its_first_token():
    sched = create_scheduler(max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    first, second = create_requests(2, prompt_len=12, max_tokens=2, seed=1)
    second.prompt_token_ids = list(first.prompt_token_ids)
    second.sampling = replace(second.sampling, prompt_logprobs=0)
    sched.add_request(first)
    outputs = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sampled = {h: [5] for h, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens)
                   if sched.handles.by_handle[h].num_computed_tokens >= sched.handles.by_handle[h].num_tokens}
        outputs += sched.update_from_output(plan, StepResult(plan.step_id, sampled=sampled))
    sched.add_request(second)
    assert sched.kv.get_computed_blocks(second) == ([], 0)   # the prompt is cached, but not for this one
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sampled, plps = {}, {}
        for h, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            req = sched.handles.by_handle[h]
            start = req.num_computed_tokens - n
            plps[h] = [lp(t) for t in range(start + 1, min(start + n, 11) + 1)]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[h] = [5]
        outputs += sched.update_from_output(plan, StepResult(plan.step_id, sampled=sampled, prompt_logprobs=plps))
    mine = [o for o in outputs if o.request_id == second.request_id]
    assert mine[0].prompt_logprobs is not None and len(mine[0].prompt_logprobs) == 11
    assert [x.logprob for x in mine[0].prompt_logprobs] == [-float(t) for t in range(1, 12)]
    assert all(o.prompt_logprobs is None for o in mine[1:])
    assert mine[0].num_cached_tokens == 0
