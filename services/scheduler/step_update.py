"""update_from_output's work on one step's result: append the sampled tokens, apply the stop rule, key newly
full blocks, finish requests, and build one RequestOutput per request that sampled.

`apply_result` walks the step's requests once, each through the one Python path (prompt logprobs, a pooled
vector, a prompt chunk, sampled tokens), and a new per-request outcome is one more branch in that walk. In a
plain step (see `is_plain`), runs of plain decodes go through the C loop instead (fastpath/decode_loop.c's
apply_decodes), which builds the same outputs and returns at the first request that needs anything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steploop.common.step_contract import StepPlan, StepResult, TokenLogprob
from steploop.scheduler import beam_groups
from steploop.scheduler.request import Request, RequestOutput, RequestStatus
from steploop.scheduler.request_outputs import add_prompt_logprobs, make_output
from steploop.scheduler.stop_rule import stop_status

if TYPE_CHECKING:
    from steploop.scheduler.scheduler import Scheduler

RUNNING = RequestStatus.RUNNING


def is_plain(plan: StepPlan, result: StepResult) -> bool:
    """Sampled tokens only: what the C loop handles. It knows no drafts, logprobs or pooled vectors, so any new
    per-request field of StepResult belongs in this test too."""
    return not (plan.draft_token_ids or result.logprobs or result.prompt_logprobs or result.pooled or result.failed)


def apply_result(sched: Scheduler, requests: list[Request], ends: list[int], plan: StepPlan,
                 result: StepResult) -> list[RequestOutput]:
    """`requests` were scheduled by `plan` (in its order), each reaching num_computed_tokens `ends[k]`."""
    outputs: list[RequestOutput] = []
    sampled, logprobs, drafts = result.sampled, result.logprobs, plan.draft_token_ids
    prompt_logprobs, pooled = result.prompt_logprobs, result.pooled
    handles, counts = plan.scheduled_handles, plan.num_scheduled_tokens
    c_decodes = (sched.c_loops.apply_decodes if sched.c_loops is not None and type(sampled) is dict
                 and is_plain(plan, result) else None)
    block_size, cache_blocks = sched.kv.block_size, sched.kv.cache_blocks
    groups: list[beam_groups.BeamGroup] = []     # beam groups with a beam back this step
    k, n = 0, min(len(requests), len(handles))
    while k < n:
        if c_decodes is not None:                # the run of plain decodes from k, in C (it appends outputs)
            k = c_decodes(requests, ends, handles, counts, k, sampled, outputs, block_size, cache_blocks)
            if k >= n:
                break
        request, end, handle, num_new = requests[k], ends[k], handles[k], counts[k]
        k += 1
        if request.status is not RUNNING:        # finished, aborted or preempted since the plan: dropped
            continue
        if prompt_logprobs and handle in prompt_logprobs:
            add_prompt_logprobs(request, prompt_logprobs[handle], end - num_new)
        if pooled and handle in pooled:
            outputs.append(finish_pooled(sched, request, pooled[handle], end, num_new))
            continue
        tokens = sampled.get(handle)
        if tokens is None:                       # a prompt chunk that does not reach the end: nothing sampled
            cache_full_blocks(sched, request, end, num_new)
            continue
        if type(request) is beam_groups.BeamRequest:   # parks until its group is ranked (beam_groups.py)
            cache_full_blocks(sched, request, end, num_new)
            beam_groups.on_result(sched, request, tokens[0], logprobs.get(handle) if logprobs else None)
            if request.group not in groups:
                groups.append(request.group)
            continue
        outputs.append(append_tokens(sched, request, tokens, logprobs.get(handle) if logprobs else None,
                                     drafts.get(handle) if drafts else None, end, num_new))
    if groups:
        outputs += beam_groups.advance(sched, groups)
    return outputs


def append_tokens(sched: Scheduler, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
                  drafts: list[int] | None, end: int, num_new: int) -> RequestOutput:
    if request.num_output_placeholders:          # async scheduling: the token it stood for has arrived
        request.num_output_placeholders -= 1
    if drafts:
        sched._on_drafts_verified(request)
        # Tokens = accepted drafts + 1 of the worker's own; the KV of rejected drafts is garbage and is
        # simply overwritten later.
        rejected = len(drafts) + 1 - len(tokens)
        request.num_computed_tokens -= rejected
        end -= rejected
        num_new -= rejected
        stats = sched.stats
        stats.num_spec_steps += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += len(tokens) - 1
    if request.spec_token_ids:
        request.spec_token_ids = []
    status, kept = None, 0
    for token in tokens:
        request.output_token_ids.append(token)
        kept += 1
        status = stop_status(request, token)
        if status is not None:
            break
    cache_full_blocks(sched, request, end, num_new)   # before any free: its blocks then stay cached when freed
    if status is not None:
        sched._finish(request, status)
    if kept < len(tokens):
        tokens, logprobs = tokens[:kept], logprobs[:kept] if logprobs else logprobs
    output = make_output(request, tokens, logprobs)
    if request.sends_prompt_logprobs and not request.prompt_logprobs_sent:
        output.prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
    return output


def finish_pooled(sched: Scheduler, request: Request, vector: list[float], end: int, num_new: int) -> RequestOutput:
    """An embedding request's whole prompt is computed: key its full blocks (later requests share them), finish
    it and hand out its vector; nothing was sampled."""
    cache_full_blocks(sched, request, end, num_new)
    sched._finish(request, RequestStatus.FINISHED_STOPPED)
    output = make_output(request, [], None)
    output.embedding = vector
    return output


def cache_full_blocks(sched: Scheduler, request: Request, end: int, num_new: int) -> None:
    """Key the blocks that the step's num_new tokens (ending at `end`) filled; most decodes fill none."""
    if end % sched.kv.block_size < num_new:
        sched.kv.cache_blocks(request, min(end, request.num_tokens))


def fail_requests(sched: Scheduler, requests: list[Request], error: str) -> list[RequestOutput]:
    """The worker failed the whole step: every request of it still running finishes with the error."""
    outputs = [fail_request(sched, request, error) for request in requests if request.status == RUNNING]
    return [out for out in outputs if out is not None]


def fail_request(sched: Scheduler, request: Request, error: str) -> RequestOutput | None:
    """Finish a running request with FINISHED_ERROR and `error` (why, for the client); a beam ends its group
    (None when the group already ended)."""
    if type(request) is beam_groups.BeamRequest:
        return beam_groups.fail(sched, request, error)
    request.error = error
    sched._finish(request, RequestStatus.FINISHED_ERROR)
    return make_output(request, [], None)
