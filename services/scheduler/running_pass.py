"""The running pass of schedule() (steps 1, 2 and 4 of Scheduler.schedule's docstring): drafts, then every running
request in rank order gets min(gap, budget) tokens, preempting the worst running request when blocks run out.

Each request takes the one Python path: Scheduler._num_new_tokens, kv.allocate_slots, Scheduler._add_to_batch
(which advances it with the _advance hook). When the scheduler has its C loops (fastpath/), the runs of plain
decodes between such requests go through the Scheduler._schedule_decodes hook instead, which builds the same plan
entries in C and returns at the first request it does not handle. Those are the two forms of the decode path;
tests/scheduler/test_fast_paths.py holds them to the same plans and outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steploop.common.step_contract import StepPlan
from steploop.scheduler.beam_groups import BeamRequest, schedule_group
from steploop.scheduler.ngram_proposer import propose_drafts
from steploop.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from steploop.scheduler.scheduler import Scheduler

RUNNING = RequestStatus.RUNNING


def schedule_running(sched: Scheduler, plan: StepPlan, budget: int, scheduled: list[Request],
                     ends: list[int]) -> int:
    """Schedule the running requests into `plan` (and `scheduled` / `ends`); returns the budget left."""
    running, kv, block_size, i = sched.running, sched.kv, sched.kv.block_size, 0
    c_decodes = sched._schedule_decodes if sched.c_loops is not None else None
    while i < len(running) and budget > 0:
        if c_decodes is not None:
            i, budget = c_decodes(plan, i, budget, scheduled, ends)
            if i >= len(running) or budget <= 0:
                break
        request = running[i]
        if type(request) is BeamRequest:         # a beam group is scheduled whole (beam_groups.py)
            if request.group.scheduled_step != plan.step_id:
                budget = schedule_group(sched, plan, request, budget, scheduled, ends)
            if request.status is RUNNING:        # else its group was preempted: running[i] is the next one
                i += 1
            continue
        num_new = sched._num_new_tokens(request, budget)
        if num_new <= 0 or (request.background and sched.background_yields
                            and num_new > 1 + len(request.spec_token_ids)):   # a prompt chunk yields (policy.py)
            i += 1
            continue
        computed = request.num_computed_tokens
        if num_new > -computed % block_size:     # else they fit its last block: no call (most decodes)
            while (new_blocks := kv.allocate_slots(request, num_new)) is None:
                victim = running[-1]             # the worst ranked; everything before i is better
                sched._preempt(victim, plan)
                if victim is request:
                    return budget
            if new_blocks:                       # [] when its table already had room
                plan.cached.append(request.handle, computed, new_blocks)
        sched._add_to_batch(plan, request, num_new, scheduled, ends)
        budget -= num_new
        i += 1
    return budget


def c_schedule_decodes(sched: Scheduler, plan: StepPlan, i: int, budget: int, scheduled: list[Request],
                       ends: list[int], awaiting: set[Request] | frozenset[Request], runs_ahead: bool
                       ) -> tuple[int, int]:
    """The run of plain decodes from running[i], in C; (i, budget) at the first request it leaves to Python.

    A plain decode: one token (its gap is 1), no drafts, and (with output placeholders) room to run ahead within
    its stop rule's max_output_tokens and drafts in flight not `awaiting` their verdict. Each is advanced as
    _advance does: num_computed_tokens + 1, and with `runs_ahead` one output placeholder for a request that
    samples. A decode whose last block is full gets its next block through kv.allocate_slots, called from C; when
    that finds no free block the run stops there and Python preempts. The pacer gets the run's tally at once.
    """
    kv, cached = sched.kv, plan.cached
    i, budget, num_decodes, context = sched.c_loops.schedule_decodes(
        sched.running, i, budget, sched.max_model_len - 1, kv.block_size, runs_ahead, awaiting,
        plan.scheduled_handles, plan.num_scheduled_tokens, scheduled, ends, kv.allocate_slots, cached.handles,
        cached.num_computed_tokens, cached.new_block_ids)
    if num_decodes and sched.pacer is not None:
        sched.pacer.tally_decodes(num_decodes, context)
    return i, budget


def propose(sched: Scheduler) -> None:
    """Step 1: n-gram drafts for the decoding requests that want them (they widen the gap)."""
    for request in sched.running:
        placeholders = request.num_output_placeholders
        if sched._wants_drafts(request, placeholders):
            request.spec_token_ids = propose_drafts(sched.proposer, request, placeholders, sched.max_model_len)
