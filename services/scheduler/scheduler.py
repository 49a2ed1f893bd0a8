"""Scheduler: queues, one token budget per step, preemption by recompute, stop conditions on token ids.

Transport-free: no gRPC, no torch, no asyncio. The step loop (engine_loop.py) calls `schedule()`, ships the
StepPlan to a worker, and feeds the StepResult back through `update_from_output()`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from services.common.step_contract import NewRequestData, StepPlan, StepResult, TokenLogprob
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len          # from the worker's hello, not from config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}      # every unfinished request
        self.waiting: deque[Request] = deque()      # FCFS; preempted requests go back to the front
        self.running: list[Request] = []            # in admission order
        self._by_handle: dict[int, Request] = {}
        self._free_handles: list[int] = []          # min-heap: reuse small handles, they encode in fewer bytes
        self._next_handle = 0
        self._release_after_plan: list[int] = []    # handles of finished requests, reusable after the next plan
        self._worker_handles: set[int] = set()      # handles the worker holds (sent as new, not yet dropped)
        self._finished_for_worker: list[int] = []   # dropped handles the next plan must tell the worker
        self._next_step_id = 0
        self._first_live_step = 0                   # results of plans before this went to a lost worker

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        self._validate(request)
        request.handle = self._take_handle()
        request.status = RequestStatus.WAITING
        self._by_handle[request.handle] = request
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        n, limit = request.num_prompt_tokens, self.max_model_len
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if n == 0 or n >= limit:
            raise RequestRejectedError(
                f"prompt has {n} tokens; this model's context length is {limit} tokens, so a prompt must have "
                f"1 to {limit - 1} tokens to leave room for output: shorten the prompt", "context_length_exceeded")
        # The most KV it will ever hold: every token but the last sampled one.
        final_len = min(n + request.sampling.max_tokens, limit)
        if not self.kv.can_fit(final_len - 1):
            raise RequestRejectedError(
                f"prompt ({n}) + max_tokens ({request.sampling.max_tokens}) needs KV for {final_len - 1} tokens, "
                f"but the whole KV cache holds {(self.kv.pool.num_blocks - 1) * self.kv.block_size}: "
                "lower max_tokens or give the worker more KV memory", "kv_cache_too_small")

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish the requests now and free their blocks; the worker hears of it in the next plan."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(request, [], None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Build the next step's plan. There is no prefill phase and no decode phase, only a token count:

        1. One budget of `max_num_batched_tokens` tokens for the whole step.
        2. Running requests first, best (priority, arrival) first. Each gets `min(gap, budget)` tokens where
           gap = num_tokens_with_spec + num_output_placeholders - num_computed_tokens, clipped to
           `long_prefill_token_threshold` when set and to max_model_len. A long prompt thus runs in chunks over
           several steps (chunked prefill), and a decode is just a gap of 1.
        3. If a running request cannot get blocks for its tokens, preempt the worst running request not yet
           scheduled this step (maybe itself): free its blocks, num_computed_tokens = 0, front of the waiting
           queue; it comes back later as a new request carrying its output tokens (recompute).
        4. Then waiting requests in FCFS order, while budget, max_num_seqs and free blocks allow; none in a
           step that preempted (the blocks just freed belong to the running requests that needed them).
        5. num_computed_tokens advances now by the scheduled count, as if the step had run (`_after_schedule`).
        """
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        plan.finished_handles, self._finished_for_worker = self._finished_for_worker, []
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_waiting(plan, budget)
        self._after_schedule(plan)
        self._recycle_handles()
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> tuple[int, bool]:
        pending = deque(sorted(self.running, key=self._rank))  # not yet scheduled this step, best first
        while pending and budget > 0:
            request = pending[0]
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0:
                pending.popleft()
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, pending, plan)
            if new_blocks is None:              # it preempted itself: it was the last one left
                break
            pending.popleft()
            plan.cached.append(request.handle, request.num_computed_tokens, new_blocks)
            self._add_to_batch(plan, request, num_new)
            budget -= num_new
        return budget, bool(plan.preempted_handles)   # every running request is known to the worker

    def _allocate_or_preempt(self, request: Request, num_new: int, pending: deque[Request],
                             plan: StepPlan) -> list[int] | None:
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = pending.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0 or self.kv.allocate_slots(request, num_new) is None:
                break                            # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._worker_handles.add(request.handle)
            plan.new_requests.append(NewRequestData(
                handle=request.handle, prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids), sampling=request.sampling,
                block_ids=list(self.kv.get_block_ids(request)), num_computed_tokens=request.num_computed_tokens))
            self._add_to_batch(plan, request, num_new)
            budget -= num_new

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        gap = request.num_tokens_with_spec + self._num_output_placeholders(request) - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < gap:
            gap = threshold
        # KV is needed for positions < max_model_len - 1 only: sampling from the last position would overflow.
        return min(gap, budget, self.max_model_len - 1 - request.num_computed_tokens)

    def _add_to_batch(self, plan: StepPlan, request: Request, num_new: int) -> None:
        plan.scheduled_handles.append(request.handle)
        plan.num_scheduled_tokens.append(num_new)
        # Drafts are the last tokens of the gap; send those that fall inside this step's tokens.
        num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
        if request.spec_token_ids and num_drafts > 0:
            plan.draft_token_ids[request.handle] = request.spec_token_ids[:num_drafts]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)
        if request.handle in self._worker_handles:
            self._worker_handles.discard(request.handle)
            plan.preempted_handles.append(request.handle)

    @staticmethod
    def _rank(request: Request) -> tuple[int, float]:
        """Sort key: lower runs first and is preempted last (vLLM's priority convention, then FCFS)."""
        return (request.priority, request.arrival_time)

    # ----------------------------------------------------------------- hooks for async scheduling
    def _num_output_placeholders(self, request: Request) -> int:
        """Tokens sampled by a step in flight but not yet seen here. Synchronous scheduling: always 0."""
        return 0

    def _after_schedule(self, plan: StepPlan) -> None:
        """Advance num_computed_tokens as if the plan had run, so the next schedule() sees the new gaps."""
        for handle, num_new in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            self._by_handle[handle].num_computed_tokens += num_new

    # ----------------------------------------------------------------- results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, check stops, free finished requests. One output per request touched."""
        if plan.step_id < self._first_live_step:
            return []                            # from a worker lost since: preempt_all() already recovered
        if result.error:
            return self._fail_plan(plan, result.error)
        outputs = []
        for handle, tokens in result.sampled.items():
            request = self._by_handle.get(handle)
            # Finished, aborted or preempted since the plan: its token is stale (async scheduling relies on it).
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            logprobs = result.logprobs.get(handle)
            outputs.append(self._append_tokens(request, tokens, logprobs, plan.draft_token_ids.get(handle, [])))
        return outputs

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
                       drafts: list[int]) -> RequestOutput:
        # Tokens = accepted drafts + 1 bonus; KV of rejected drafts is garbage and gets recomputed.
        request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
        request.spec_token_ids = []
        kept = 0
        for token in tokens:
            request.output_token_ids.append(token)
            kept += 1
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
                break
        return self._output(request, tokens[:kept], logprobs[:kept] if logprobs else None)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling
        if request.num_output_tokens >= params.min_tokens:
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail_plan(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        outputs = []
        for handle in plan.scheduled_handles:
            request = self._by_handle.get(handle)
            if request is not None and not request.is_finished:
                request.error = error
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(request, [], None))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._by_handle[request.handle]
        if request.handle in self._worker_handles:
            self._worker_handles.discard(request.handle)
            self._finished_for_worker.append(request.handle)
        self._release_after_plan.append(request.handle)

    def _output(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, new_token_ids=list(tokens), logprobs=logprobs,
            finish_reason=request.status if request.is_finished else None, stop_token_id=request.stop_token_id,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, error=request.error)

    # ----------------------------------------------------------------- handles
    def _take_handle(self) -> int:
        if self._free_handles:
            return heapq.heappop(self._free_handles)
        self._next_handle += 1
        return self._next_handle - 1

    def _recycle_handles(self) -> None:
        # A handle is reused only after a plan that told the worker to drop it, so a new request never shares
        # a plan with its handle's previous owner (and stale results cannot reach it, see update_from_output).
        for handle in self._release_after_plan:
            heapq.heappush(self._free_handles, handle)
        self._release_after_plan = []

    # ----------------------------------------------------------------- worker loss, integrity
    def preempt_all(self) -> None:
        """The worker is gone: every running request is preempted (keeps its output) and waits for a new one."""
        for request in sorted(self.running, key=self._rank, reverse=True):
            self._preempt(request, StepPlan(step_id=-1))   # a throwaway plan: no worker to tell
        self._worker_handles.clear()
        self._finished_for_worker = []
        self._first_live_step = self._next_step_id

    def drain_requests(self) -> list[Request]:
        """Take every unfinished request out (blocks freed, to be recomputed), best first, for a new scheduler.

        Used when a worker with a different KV pool attaches; the caller re-adds them elsewhere.
        """
        self.preempt_all()
        drained = list(self.waiting)
        for request in drained:
            self.kv.free(request)
            request.status = RequestStatus.WAITING
        self.waiting.clear()
        self.requests.clear()
        self._by_handle.clear()
        return drained

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert len(self.running) <= self.config.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request.request_id} running as {request.status!r}"
            covered = len(self.kv.get_block_ids(request)) * self.kv.block_size
            assert covered >= request.num_computed_tokens, (
                f"{request.request_id}: {request.num_computed_tokens} computed tokens but blocks cover {covered}")
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.status
            assert request.num_computed_tokens == 0 and not self.kv.get_block_ids(request), request.request_id
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert len(live) == len(self.running) + len(self.waiting) == len(self.requests), "queues disagree"
        assert set(self.kv.request_ids) <= live, f"blocks held by dead requests: {set(self.kv.request_ids) - live}"
