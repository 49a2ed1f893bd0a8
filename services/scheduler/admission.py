"""Waiting-queue admission (step 5 of Scheduler.schedule's docstring), and the priority policy's preemptions
that make room for the waiting head before the running pass.

A waiting request is admitted at its longest cached prefix while the budget, max_num_seqs, free blocks (less the
admission watermark) and its LoRA adapter's seat allow; the first that does not fit stops admission for the step
(nobody overtakes the head), except a request whose adapter has no seat: it is set aside for the step and the
queue goes on.

Blocks are checked for the whole context, not the first chunk: beside running requests, a request is admitted
only when the free blocks (evictable prefix-cache blocks count as free) hold all of its tokens plus what the
running ones were promised (the rest of their prompts, their next token). Admitted at its first chunk only, a
long prompt would take blocks the others need to grow and be preempted before it finished: thrash. Alone, a
request is admitted as soon as its first chunk fits (add_request refused any that the whole pool cannot hold), so
the head waits at most until the running requests end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steploop.common.step_contract import NewRequestData, StepPlan
from steploop.scheduler import policy
from steploop.scheduler.kv_tiers import restore_is_worth
from steploop.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from steploop.scheduler.scheduler import Scheduler


def schedule_waiting(sched: Scheduler, plan: StepPlan, budget: int, scheduled: list[Request],
                     ends: list[int]) -> None:
    waiting, kv = sched.waiting, sched.kv
    skipped: list[Request] = []                  # their adapter has no seat (--max-loras): they wait, others go
    promised = Promised(sched)                   # blocks the running requests will still take
    while waiting and budget > 0 and len(sched.running) < sched.config.max_num_seqs:
        request = waiting.peek()
        if not sched.lora.can_run(request):
            skipped.append(waiting.pop())
            continue
        hits, num_hit = kv.get_computed_blocks(request)
        restored = tier_restore(sched, request, len(hits)) if kv.tiers is not None else ()
        if restored is None:
            break                                # its prefix is on its way up from disk: it waits, nobody overtakes
        num_pool_hit, num_hit = num_hit, num_hit + len(restored) * kv.block_size
        request.num_computed_tokens = num_hit
        num_new = sched._num_new_tokens(request, budget)
        reserve = 0                              # alone, a request may use every block
        if sched.running:
            reserve = sched.watermark_blocks
            if not promised.covered_by(kv.num_free_blocks - reserve - kv.num_blocks_to_hold(request, hits)):
                num_new = 0                      # its whole context does not fit beside theirs: it waits
        if num_new <= 0 or kv.allocate_slots(request, num_new, hits, reserve, restored) is None:
            request.num_computed_tokens = 0
            break                                # nobody overtakes the head of the queue
        promised.add(request)
        waiting.pop()
        if kv.tiers is not None:
            kv.tiers.record_admission(request.request_id, request.num_tokens, num_pool_hit, num_hit - num_pool_hit,
                                      kv.block_size)
        admit(sched, plan, request, num_hit)
        sched._add_to_batch(plan, request, num_new, scheduled, ends)
        budget -= num_new
    for request in reversed(skipped):
        waiting.push_front(request)


class Promised:
    """The free blocks the running requests will still take (KVCacheManager.num_blocks_promised), found once per
    step and only as precisely as a decision needs: first an upper bound (exact for the requests admitted with a
    prompt chunk, `sched.prompting`; 2 blocks for any other: its next token, and one more if it was not scheduled
    this step), the exact sum over every running request (O(running)) only when the bound leaves no room."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bound: int | None = None
        self.exact: int | None = None

    def covered_by(self, slack: int) -> bool:
        """Do `slack` free blocks (left once a request took its whole context) hold what was promised?"""
        sched = self.sched
        if slack < 0:
            return False
        if self.bound is None:
            prompting = sched.prompting
            for rid in [rid for rid, r in prompting.items() if r.status != RequestStatus.RUNNING
                        or r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders]:
                del prompting[rid]               # ended, preempted, or its prompt is done
            self.bound = sched.kv.num_blocks_promised(list(prompting.values())) + 2 * len(sched.running)
        if slack >= self.bound:
            return True
        if self.exact is None:
            self.exact = sched.kv.num_blocks_promised(sched.running)
        return slack >= self.exact

    def add(self, request: Request) -> None:
        """`request` was just admitted: the rest of its context is promised too."""
        n = self.sched.kv.num_blocks_promised([request])
        self.bound = None if self.bound is None else self.bound + n
        self.exact = None if self.exact is None else self.exact + n
        if request.num_computed_tokens < request.num_tokens:
            self.sched.prompting[request.request_id] = request


def tier_restore(sched: Scheduler, request: Request, num_pool_blocks: int) -> list[int] | None:
    """Host-tier slots of the request's blocks right after its pool hits, to load (kv_tiers.py); None: it waits
    for blocks promoted from disk. Restored only when copying is cheaper than recomputing (step-cost model)."""
    kv = sched.kv
    if not kv.enable_prefix_caching or request.sampling.prompt_logprobs >= 0 or request.no_prefix_hits:
        return []
    max_blocks = (request.num_tokens - 1) // kv.block_size
    if num_pool_blocks >= max_blocks:
        return []
    cost = sched.pacer.cost.coefficients() if sched.pacer is not None else None
    tiers, start = kv.tiers, num_pool_blocks * kv.block_size
    worth = lambda n: restore_is_worth(tiers.seconds_per_block, cost, n, kv.block_size, start + n * kv.block_size)
    return tiers.restore_for(request.request_id, request.block_hashes, num_pool_blocks, max_blocks, worth)


def admit(sched: Scheduler, plan: StepPlan, request: Request, num_hit: int) -> None:
    """The request runs from this step: the plan carries it in full (its blocks, the tokens already computed)."""
    kv = sched.kv
    if request.status == RequestStatus.WAITING:  # first admission: what usage.cached_tokens reports
        request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
    if kv.enable_prefix_caching:
        kv.prefix_cache_stats.record(request.num_tokens, num_hit)
    request.status = RequestStatus.RUNNING
    sched.running.add(request)
    sched.lora.start(request, plan)
    sched.handles.on_worker.add(request.handle)
    plan.new_requests.append(NewRequestData(
        handle=request.handle, prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids), sampling=request.sampling,
        block_ids=list(kv.get_block_ids(request)), num_computed_tokens=num_hit, pooling=request.pooling,
        lora_name=request.lora_name or "", mm_features=request.mm_features))


def preempt_for_waiting(sched: Scheduler, plan: StepPlan) -> None:
    """Preempt the running requests of a worse class the policy names so the waiting head fits next step (every
    policy: background ones for an interactive head), and under the priority policy those whose adapter holds the
    seat the head's adapter needs (LoraSteps.victims_for)."""
    config, head = sched.config, sched.waiting.peek()
    # Room for its whole context, as schedule_waiting asks (not just a first chunk).
    for victim in policy.victims_for_waiting(head, sched.running, sched.kv, config.max_num_seqs,
                                             sched.watermark_blocks, head.num_tokens):
        sched._preempt(victim, plan)
    if config.scheduling_policy != "priority":
        return
    for victim in sched.lora.victims_for(sched.waiting.peek(), sched.running):
        sched._preempt(victim, plan)
