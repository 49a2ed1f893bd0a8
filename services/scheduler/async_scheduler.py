"""AsyncScheduler: plans step N+1 before step N's result is back, so the worker never waits for a round trip.

The engine loop keeps ONE plan in flight:  plan N+1 = schedule();  update_from_output(plan N, result N);  ...
A request that samples in step N gets one *output placeholder*: the token exists on the worker (which feeds it
into step N+1 itself) but not here yet. The gap then counts it,

    gap = num_tokens_with_spec + num_output_placeholders - num_computed_tokens,

so a decoding request is scheduled one token ahead; the placeholder goes when the token arrives. Outputs are the
same as with synchronous scheduling: a request that stops at step N had its step N+1 token computed in vain,
and that result is dropped (update_from_output ignores finished requests). It is never scheduled past
max_tokens or max_model_len, which are known in advance.

Speculative decoding: a request whose in-flight step carries drafts is not scheduled again until its result
says how many were accepted (its num_computed_tokens is unknown until then), so a drafting request runs every
other step: the price of keeping the scheduler's counts exact without a round trip. Drafts for a request with a
placeholder in flight guess the placeholder's token too (running_pass.propose); a wrong guess only means
rejected drafts, since the worker verifies every draft against what it samples.

The placeholders come in through the scheduler's hooks: `_advance` on the Python path and `_schedule_decodes` for
the runs of plain decodes in C, which count one each the same way; both paths drop one when its token arrives
(step_update.py, decode_loop.c), and `_on_drafts_verified` ends the wait for drafts.
"""

from __future__ import annotations

from steploop.common.step_contract import StepPlan
from steploop.scheduler import running_pass
from steploop.scheduler.beam_groups import BeamRequest
from steploop.scheduler.lora_steps import LoraSteps
from steploop.scheduler.pipeline_scheduler import PipelineScheduler
from steploop.scheduler.request import Request, RequestStatus
from steploop.scheduler.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_drafts: set[Request] = set()   # a step in flight verifies their drafts

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders:
            if request in self._awaiting_drafts:
                return 0                         # wait for how many drafts were accepted
            if request.num_output_tokens + placeholders >= request.max_output_tokens:
                return 0                         # its last token (stop_rule.py) is already being sampled
        return super()._num_new_tokens(request, budget)

    def _wants_drafts(self, request: Request, placeholders: int) -> bool:
        return request not in self._awaiting_drafts and super()._wants_drafts(request, placeholders)

    def _advance(self, plan: StepPlan, request: Request, num_new: int) -> int:
        # It samples iff its tokens (drafts aside) reach the end of what the worker knows: the tokens seen here
        # plus the placeholders in flight.
        drafts = plan.draft_token_ids
        num_drafts = len(drafts.get(request.handle, ())) if drafts else 0
        end = request.num_computed_tokens + num_new
        if (end - num_drafts >= request.num_tokens + request.num_output_placeholders and request.pooling is None
                and type(request) is not BeamRequest):   # a beam waits for its group's ranking (beam_groups.py)
            request.num_output_placeholders += 1
        if num_drafts:
            self._awaiting_drafts.add(request)
        request.num_computed_tokens = end
        return end

    def _schedule_decodes(self, plan: StepPlan, i: int, budget: int, scheduled: list[Request],
                          ends: list[int]) -> tuple[int, int]:
        # What _advance does, in C: a placeholder for each decode that samples; none while its drafts are awaited.
        return running_pass.c_schedule_decodes(self, plan, i, budget, scheduled, ends, self._awaiting_drafts, True)

    def _on_drafts_verified(self, request: Request) -> None:
        self._awaiting_drafts.discard(request)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self._awaiting_drafts.discard(request)
        super()._preempt(request, plan)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._awaiting_drafts.discard(request)
        super()._finish(request, status)


def make_scheduler(config, kv, max_model_len: int, eos_token_ids=(), pooling=None,
                   lora: LoraSteps | None = None, pipeline_parallel_size: int = 1) -> Scheduler:
    """The scheduler class the config asks for: PipelineScheduler for pipeline stages (one plan in flight per
    stage, pipeline_scheduler.py), else AsyncScheduler when async_scheduling is on."""
    if pipeline_parallel_size > 1:
        return PipelineScheduler(config, kv, max_model_len, eos_token_ids, pooling, lora,
                                 num_stages=pipeline_parallel_size)
    cls = AsyncScheduler if config.async_scheduling else Scheduler
    return cls(config, kv, max_model_len, eos_token_ids, pooling, lora)


def plans_in_flight(config, pipeline_parallel_size: int = 1) -> int:
    """How many plans the step loop keeps outstanding: one per pipeline stage, two under async scheduling."""
    if pipeline_parallel_size > 1:
        return pipeline_parallel_size
    return 2 if config.async_scheduling else 1
