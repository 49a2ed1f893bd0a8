"""Scheduler: queues, one token budget per step, preemption by recompute, stop conditions on token ids.

Transport-free: no gRPC, no torch, no asyncio. The step loop (engine_loop.py) calls `schedule()`, ships the
StepPlan to a worker, and feeds the StepResult back through `update_from_output()`. Concerns live beside it:
policy.py (queue order, victims), kv_cache_manager.py + prefix_cache.py (blocks, hits), ngram_proposer.py
(drafts), handles.py, request_outputs.py (stops); async_scheduler.py subclasses this for one plan in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from services.common.pooling_params import PoolingConfig
from services.common.step_contract import NewRequestData, StepPlan, StepResult, TokenLogprob
from services.scheduler import fastpath, policy
from services.scheduler.config import SchedulerConfig
from services.scheduler.handles import HandleTable
from services.scheduler.integrity import check_scheduler
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.lora_steps import LoraSteps
from services.scheduler.ngram_proposer import NgramProposer, propose_drafts
from services.scheduler.prefill_pacing import PrefillPacer
from services.scheduler.request import Request, RequestOutput, RequestStatus
from services.scheduler.request_failures import end_failed
from services.scheduler.request_outputs import (
    add_prompt_logprobs,
    check_runner,
    make_output,
    stop_status,
    validate_pooling_request,
    validate_request,
)
from services.scheduler.stats import SchedulerCounters, SchedulerStats

log = logging.getLogger(__name__)

RUNNING = RequestStatus.RUNNING


class Scheduler:
    runs_ahead = False                           # schedules tokens sampled by a step in flight (async scheduling)

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), pooling: PoolingConfig | None = None,
                 lora: LoraSteps | None = None) -> None:
        """pooling: the worker's PoolingConfig when it runs `--runner pooling` (then it serves embedding requests
        only: prompt-only, finished with the worker's pooled vector, no sampling), else None. lora: the LoRA
        step resource (lora_steps.py); None: no adapters."""
        self.config = config
        self.kv = kv
        if kv.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError(f"the KV cache manager has enable_prefix_caching={kv.enable_prefix_caching} but the "
                             f"scheduler config has {config.enable_prefix_caching}: build the manager with "
                             "KVCacheManager(..., enable_prefix_caching=config.enable_prefix_caching)")
        self.max_model_len = max_model_len          # from the worker's hello, not from config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pooling = pooling
        self.requests: dict[str, Request] = {}      # every unfinished request
        self.waiting, self.running = policy.make_queues(config.scheduling_policy)
        self.handles = HandleTable()
        self.lora = lora or LoraSteps(1)             # adapters are a step resource (lora_steps.py)
        self.stats = SchedulerStats()
        # Admissions leave this many blocks free (running requests may use them): see SchedulerConfig.
        self.watermark_blocks = int(config.admission_watermark * kv.num_usable_blocks)
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                       config.prompt_lookup_max) if config.num_speculative_tokens else None)
        self.pacer = (PrefillPacer(config.max_decode_slowdown, kv.block_size)
                      if config.max_decode_slowdown > 0 else None)
        # step_id -> (requests scheduled, num_computed_tokens each reaches) for plans whose result is pending.
        self._in_flight: dict[int, tuple[list[Request], list[int]]] = {}
        self._next_step_id = 0
        self._first_live_step = 0                   # results of plans before this went to a lost worker
        self._awaiting_drafts: set[Request] = set()   # async scheduling: a step in flight verifies their drafts
        # Request.stop_ids without stop_token_ids, by ignore_eos: shared, so the per-token check hits a hot set.
        self._no_stop_ids = {False: self.eos_token_ids, True: frozenset()}
        # The plain-decode runs of the two hot loops in C (fastpath/decode_loop.c), or None: Python throughout.
        self.c_loops = fastpath.load()

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_runner(request, self.pooling)
        if request.pooling is not None:
            self._add_pooling_request(request)
            return
        validate_request(request, self.kv, self.max_model_len)
        params = request.sampling
        request.stop_ids = (frozenset(params.stop_token_ids) | self._no_stop_ids[params.ignore_eos]
                            if params.stop_token_ids else self._no_stop_ids[params.ignore_eos])
        request.max_output_tokens = min(params.max_tokens, self.max_model_len - request.num_prompt_tokens)
        request.num_prompt = len(request.prompt_token_ids)
        request.sends_prompt_logprobs = params.prompt_logprobs >= 0
        self._enqueue(request)

    def _add_pooling_request(self, request: Request) -> None:
        """Prompt only: no output token, so no stop ids; its last chunk's result carries the pooled vector."""
        validate_pooling_request(request, self.kv, self.max_model_len, self.pooling)
        request.max_output_tokens = 0
        request.num_prompt = len(request.prompt_token_ids)
        request.no_prefix_hits = self.pooling.pools_every_position
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.handles.assign(request)
        self.lora.add(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish the requests now and free their blocks; the worker hears of it in the next plan."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(make_output(request, [], None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def counters(self) -> SchedulerCounters:
        """This scheduler's monotonic counts since it was built (metrics)."""
        stats, prefix, pacer = self.stats, self.kv.prefix_cache_stats, self.pacer
        return SchedulerCounters(
            preemptions=stats.num_preemptions, prefix_queries=prefix.queries, prefix_hits=prefix.hits,
            spec_drafts=stats.num_spec_steps, draft_tokens=stats.num_draft_tokens,
            accepted_tokens=stats.num_accepted_tokens, paced_steps=pacer.num_paced_steps if pacer else 0,
            deferred_prompt_tokens=pacer.num_deferred_tokens if pacer else 0)

    def step_cost(self) -> tuple[float, float] | None:
        """Prefill pacing's learned step time (base seconds, seconds per token); None until it has one."""
        coef = self.pacer.cost.coefficients() if self.pacer is not None else None
        return None if coef is None else (coef[0], coef[1])

    def new_request_ids(self, plan: StepPlan) -> list[str]:
        """The request ids of the plan's new requests, in order (call before the next schedule())."""
        by_handle = self.handles.by_handle
        return [by_handle[new.handle].request_id for new in plan.new_requests]

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Build the next step's plan. There is no prefill phase and no decode phase, only a token count:

        1. One budget of `max_num_batched_tokens` tokens for the whole step. Decoding requests first get n-gram
           drafts (when on), which widen their gap.
        2. Running requests first, best rank first (policy.py). Each gets `min(gap, budget)` tokens where
           gap = num_tokens_with_spec + num_output_placeholders - num_computed_tokens, clipped to
           `long_prefill_token_threshold` when set and to max_model_len. A long prompt thus runs in chunks over
           several steps (chunked prefill), and a decode is just a gap of 1.
        3. If a running request cannot get blocks for its tokens, preempt the worst running request (last in
           rank, not yet scheduled this step; maybe itself): free its blocks, num_computed_tokens = 0, back to
           the waiting queue; it comes back later as a new request carrying its output tokens (recompute).
        4. Then waiting requests in queue order, each starting at its longest cached prefix, while budget,
           max_num_seqs and free blocks (minus the admission watermark) allow; none in a step that preempted
           (the blocks just freed belong to the running requests that needed them). Under the priority policy
           a better waiting request that cannot fit preempts worse running ones first (it is admitted next step).
        5. num_computed_tokens advances by the scheduled count as each request is scheduled, as if the step had
           run (`_advance`), so the next schedule() sees the new gaps.
        """
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        plan.finished_handles = self.handles.take_finished()
        self.lora.fill_plan(plan)
        if self.proposer is not None:
            self._propose_drafts()
        if self.config.scheduling_policy == "priority" and self.waiting and self.running:
            self._preempt_for_waiting(plan)
        scheduled: list[Request] = []
        ends: list[int] = []                     # num_computed_tokens each scheduled request reaches
        if self.pacer is not None:
            self.pacer.begin_step(len(self.running))
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens, scheduled, ends)
        if not plan.preempted_handles:
            self._schedule_waiting(plan, budget, scheduled, ends)
        if scheduled:
            self._in_flight[plan.step_id] = (scheduled, ends)
        if self.pacer is not None:
            self.pacer.end_step(plan.step_id)
        self.handles.recycle()
        return plan

    def _preempt_for_waiting(self, plan: StepPlan) -> None:
        """Priority policy: preempt the running requests the policy names so the waiting head fits next step."""
        config = self.config
        max_new = config.max_num_batched_tokens
        if config.long_prefill_token_threshold > 0:
            max_new = min(max_new, config.long_prefill_token_threshold)
        for victim in policy.victims_for_waiting(self.waiting.peek(), self.running, self.kv, config.max_num_seqs,
                                                 self.watermark_blocks, max_new):
            self._preempt(victim, plan)
        for victim in self.lora.victims_for(self.waiting.peek(), self.running):   # its adapter needs a seat
            self._preempt(victim, plan)

    def _schedule_running(self, plan: StepPlan, budget: int, scheduled: list[Request], ends: list[int]) -> int:
        # Hot path: once per running request per step. A plain decode (gap 1, no drafts, room to run ahead) is
        # worked out and advanced inline (what _advance does for it), with the pacer's tally summed once after
        # the loop; everything else goes through _num_new_tokens / _add_to_batch / _advance. Placeholders (async
        # scheduling) only run ahead within max_tokens and max_model_len, and not while drafts in flight await
        # their verdict (AsyncScheduler._num_new_tokens). Request fields are read once each, and the prompt's
        # length comes from request.num_prompt, so the loop does not touch the prompt lists.
        running, kv, i, awaiting = self.running, self.kv, 0, self._awaiting_drafts
        add_handle, add_count, add_scheduled, add_end = (plan.scheduled_handles.append,
                                                         plan.num_scheduled_tokens.append, scheduled.append,
                                                         ends.append)
        last_position, block_size, runs_ahead = self.max_model_len - 1, kv.block_size, self.runs_ahead
        num_decodes = decode_context = 0
        c_decodes = self.c_loops.schedule_decodes if self.c_loops is not None else None
        cached = plan.cached
        while i < len(running) and budget > 0:
            if c_decodes is not None:            # the run of plain decodes from i, in C (next blocks through
                i, budget, n, context = c_decodes(   # kv.allocate_slots); it stops before the first it does not do
                    running, i, budget, last_position, block_size, runs_ahead, awaiting, plan.scheduled_handles,
                    plan.num_scheduled_tokens, scheduled, ends, kv.allocate_slots, cached.handles,
                    cached.num_computed_tokens, cached.new_block_ids)
                num_decodes += n
                decode_context += context
                if i >= len(running) or budget <= 0:
                    break
            request = running[i]
            computed, placeholders = request.num_computed_tokens, request.num_output_placeholders
            num_output = len(request.output_token_ids)
            decode = (request.num_prompt + num_output + placeholders - computed == 1 and computed < last_position
                      and not request.spec_token_ids
                      and (not placeholders or (num_output + placeholders < request.max_output_tokens
                                                and (not awaiting or request not in awaiting))))
            num_new = 1 if decode else self._num_new_tokens(request, budget)
            if num_new <= 0:
                i += 1
                continue
            if not decode or computed % block_size == 0:   # a decode with room in its last block needs no block
                while (new_blocks := kv.allocate_slots(request, num_new)) is None:
                    victim = running[-1]         # the worst ranked; everything before i is better
                    self._preempt(victim, plan)
                    if victim is request:
                        self._tally_decodes(num_decodes, decode_context)
                        return budget
                if new_blocks:                   # [] when its last block still has room
                    cached.append(request.handle, computed, new_blocks)
            if decode:
                add_handle(request.handle)
                add_count(1)
                add_scheduled(request)
                request.num_computed_tokens = computed = computed + 1
                if runs_ahead and request.max_output_tokens:   # it samples (not pooling): one more placeholder
                    request.num_output_placeholders = placeholders + 1
                add_end(computed)
                num_decodes += 1
                decode_context += computed
                budget -= 1
                i += 1
                continue
            self._add_to_batch(plan, request, num_new)
            add_scheduled(request)
            add_end(self._advance(plan, request, num_new))
            budget -= num_new
            i += 1
        self._tally_decodes(num_decodes, decode_context)
        return budget

    def _tally_decodes(self, num_decodes: int, context: int) -> None:
        """The pacer's tally of the step's inline decodes: 1 token each, `context` = the sum of their ends."""
        if self.pacer is not None and num_decodes:
            self.pacer.tally_decodes(num_decodes, context)

    def _schedule_waiting(self, plan: StepPlan, budget: int, scheduled: list[Request], ends: list[int]) -> None:
        skipped: list[Request] = []              # their adapter has no seat (--max-loras): they wait, others go
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self.lora.can_run(request):
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_hit
            num_new = self._num_new_tokens(request, budget)
            reserve = self.watermark_blocks if self.running else 0   # alone, a request may use every block
            if num_new <= 0 or self.kv.allocate_slots(request, num_new, hits, reserve) is None:
                request.num_computed_tokens = 0
                break                            # nobody overtakes the head of the queue
            self.waiting.pop()
            self._admit(plan, request, num_hit)
            self._add_to_batch(plan, request, num_new)
            scheduled.append(request)
            ends.append(self._advance(plan, request, num_new))
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.push_front(request)

    def _admit(self, plan: StepPlan, request: Request, num_hit: int) -> None:
        if request.status == RequestStatus.WAITING:  # first admission: what usage.cached_tokens reports
            request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
        if self.kv.enable_prefix_caching:
            self.kv.prefix_cache_stats.record(request.num_tokens, num_hit)
        request.status = RUNNING
        self.running.add(request)
        self.lora.start(request, plan)
        self.handles.on_worker.add(request.handle)
        plan.new_requests.append(NewRequestData(
            handle=request.handle, prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids), sampling=request.sampling,
            block_ids=list(self.kv.get_block_ids(request)), num_computed_tokens=num_hit, pooling=request.pooling,
            lora_name=request.lora_name or ""))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        # Hot path (once per running request per step): lengths read directly instead of via properties.
        computed = request.num_computed_tokens
        gap = (len(request.prompt_token_ids) + len(request.output_token_ids) + len(request.spec_token_ids)
               + self._num_output_placeholders(request) - computed)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < gap:
            gap = threshold
        # KV is needed for positions < max_model_len - 1 only: sampling from the last position would overflow.
        # An embedding request samples nothing: its prompt may fill the context.
        num_new = min(gap, budget, self.max_model_len - (request.pooling is None) - computed)
        if self.pacer is not None and gap > 1 + len(request.spec_token_ids):     # a prompt chunk, not a decode
            num_new = self.pacer.clip(num_new, computed)
        return num_new

    def _add_to_batch(self, plan: StepPlan, request: Request, num_new: int) -> None:
        plan.scheduled_handles.append(request.handle)
        plan.num_scheduled_tokens.append(num_new)
        if self.pacer is not None:
            self.pacer.tally(num_new, request.num_computed_tokens + num_new,
                             is_decode=num_new <= 1 + len(request.spec_token_ids))
        if request.spec_token_ids:
            # Drafts are the last tokens of the gap; send those that fall inside this step's tokens.
            known = request.num_tokens + self._num_output_placeholders(request) - request.num_computed_tokens
            if num_new > known:
                plan.draft_token_ids[request.handle] = request.spec_token_ids[:num_new - known]

    def _propose_drafts(self) -> None:
        for request in self.running:
            placeholders = self._num_output_placeholders(request)
            if self._wants_drafts(request, placeholders):
                request.spec_token_ids = propose_drafts(self.proposer, request, placeholders, self.max_model_len)

    def _wants_drafts(self, request: Request, placeholders: int) -> bool:
        """Only a request in the decode state: its KV covers all but its last token (not mid-prompt); never an
        embedding request (it samples nothing to verify drafts against)."""
        return request.pooling is None and request.num_computed_tokens == request.num_tokens + placeholders - 1

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.lora.stop(request)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if self.running and self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)
        self.waiting.push_front(request)
        if self.handles.unload(request):
            plan.preempted_handles.append(request.handle)
        log.info("preempted %s (priority %d, %d tokens, preemption #%d); it will be recomputed",
                 request.request_id, request.priority, request.num_tokens, request.num_preemptions)

    # ----------------------------------------------------------------- hooks for async scheduling
    def _num_output_placeholders(self, request: Request) -> int:
        """Tokens sampled by a step in flight but not yet seen here. Synchronous scheduling: always 0."""
        return 0

    def _advance(self, plan: StepPlan, request: Request, num_new: int) -> int:
        """Advance num_computed_tokens by the request's scheduled tokens as if the plan had run (so the next
        schedule() sees the new gap); returns the count it reaches."""
        request.num_computed_tokens += num_new
        return request.num_computed_tokens

    def _on_sampled(self, request: Request, drafts: list[int] | None) -> None:
        """A step's sampled tokens for the request arrived (async scheduling drops a placeholder here)."""

    # ----------------------------------------------------------------- results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, check stops, key newly full blocks, free finished requests.

        Returns one output per request that sampled. Results for requests finished, aborted or preempted since
        the plan was built are dropped (async scheduling relies on it), and so are results of plans sent to a
        worker that was lost since.
        """
        in_flight = self._in_flight.pop(plan.step_id, None)
        if plan.step_id < self._first_live_step or in_flight is None:
            return []
        if self.pacer is not None:
            self.pacer.observe(plan.step_id, result.forward_seconds)
        if result.error:
            return self._fail_plan(in_flight[0], result.error)
        if result.failed:   # requests the worker cannot serve as asked end alone; the rest go on
            return (end_failed(self, in_flight[0], plan.scheduled_handles, result.failed)
                    + self._apply_results(in_flight, plan, result))
        if plan.draft_token_ids or result.logprobs or result.prompt_logprobs or result.pooled:
            return self._apply_results(in_flight, plan, result)
        return self._apply_tokens(in_flight, plan, result.sampled)

    def _apply_results(self, in_flight: tuple[list[Request], list[int]], plan: StepPlan,
                       result: StepResult) -> list[RequestOutput]:
        """update_from_output for a step with drafts, logprobs, prompt logprobs or pooled vectors."""
        outputs, sampled, logprobs, all_drafts = [], result.sampled, result.logprobs, plan.draft_token_ids
        prompt_logprobs, pooled = result.prompt_logprobs, result.pooled
        for request, end, handle, num_new in zip(*in_flight, plan.scheduled_handles, plan.num_scheduled_tokens):
            if request.status is not RUNNING:
                continue
            if prompt_logprobs and handle in prompt_logprobs:
                add_prompt_logprobs(request, prompt_logprobs[handle], end - num_new)
            if pooled and handle in pooled:
                outputs.append(self._finish_pooled(request, pooled[handle], end, num_new))
                continue
            tokens = sampled.get(handle)
            if tokens is None:                   # a prompt chunk that does not reach the end: nothing sampled
                self._cache_blocks(request, end, num_new)
                continue
            drafts = all_drafts.get(handle) if all_drafts else None
            outputs.append(self._append_tokens(request, tokens, logprobs.get(handle) if logprobs else None,
                                               drafts, end, num_new))
        return outputs

    def _apply_tokens(self, in_flight: tuple[list[Request], list[int]], plan: StepPlan,
                      sampled: dict[int, list[int]]) -> list[RequestOutput]:
        """update_from_output for the usual step: sampled tokens only. Hot path (once per request per step):
        one token that cannot stop the request is appended inline; anything else goes through _append_tokens."""
        outputs, block_size, kv, running = [], self.kv.block_size, self.kv, RUNNING
        add_output, get_tokens = outputs.append, sampled.get
        requests, ends = in_flight
        handles, counts = plan.scheduled_handles, plan.num_scheduled_tokens
        c_decodes = self.c_loops.apply_decodes if self.c_loops is not None and type(sampled) is dict else None
        k, n = 0, min(len(requests), len(handles))
        while k < n:
            if c_decodes is not None:            # the run of plain decodes from k, in C (it appends their
                k = c_decodes(requests, ends, handles, counts, k, sampled, outputs, block_size,   # outputs)
                              kv.cache_blocks)
                if k >= n:
                    break
            request, end, handle, num_new = requests[k], ends[k], handles[k], counts[k]
            k += 1
            if request.status is not running:
                continue
            tokens = get_tokens(handle)
            if tokens is None:                   # a prompt chunk that does not reach the end: nothing sampled
                self._cache_blocks(request, end, num_new)
                continue
            output_ids = request.output_token_ids
            num_output = len(output_ids) + 1
            if (len(tokens) != 1 or tokens[0] in request.stop_ids or num_output >= request.max_output_tokens
                    or request.sends_prompt_logprobs or request.spec_token_ids):
                add_output(self._append_tokens(request, tokens, None, None, end, num_new))
                continue
            if request.num_output_placeholders:  # what _on_sampled does for a step without drafts
                request.num_output_placeholders -= 1
            output_ids.append(tokens[0])
            num_prompt = request.num_prompt
            if end % block_size < num_new:       # it filled a block: key it (_cache_blocks)
                kv.cache_blocks(request, min(end, num_prompt + num_output))
            add_output(RequestOutput(request.request_id, tokens, None, None, None, num_prompt, num_output,
                                     request.num_cached_tokens))
        return outputs

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
                       drafts: list[int] | None, end: int, num_new: int) -> RequestOutput:
        self._on_sampled(request, drafts)
        if drafts:
            # Tokens = accepted drafts + 1 of the worker's own; the KV of rejected drafts is garbage and is
            # simply overwritten later.
            rejected = len(drafts) + 1 - len(tokens)
            request.num_computed_tokens -= rejected
            end -= rejected
            num_new -= rejected
            self._count_drafts(len(drafts), len(tokens) - 1)
        if request.spec_token_ids:
            request.spec_token_ids = []
        status, kept = None, 0
        for token in tokens:
            request.output_token_ids.append(token)
            kept += 1
            status = stop_status(request, token, self.eos_token_ids, self.max_model_len)
            if status is not None:
                break
        self._cache_blocks(request, end, num_new)   # before any free: its blocks then stay cached when freed
        if status is not None:
            self._finish(request, status)
        if kept < len(tokens):
            tokens, logprobs = tokens[:kept], logprobs[:kept] if logprobs else logprobs
        output = make_output(request, tokens, logprobs)
        if request.sampling.prompt_logprobs >= 0 and not request.prompt_logprobs_sent:
            output.prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return output

    def _finish_pooled(self, request: Request, vector: list[float], end: int, num_new: int) -> RequestOutput:
        """An embedding request's whole prompt is computed: key its full blocks (later requests share them),
        finish it and hand out its vector; nothing was sampled."""
        self._cache_blocks(request, end, num_new)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        output = make_output(request, [], None)
        output.embedding = vector
        return output

    def _cache_blocks(self, request: Request, end: int, num_new: int) -> None:
        """Key the blocks that the step's num_new tokens (ending at `end`) filled; most decodes fill none."""
        if end % self.kv.block_size < num_new:
            self.kv.cache_blocks(request, min(end, request.num_tokens))

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted

    def _fail_plan(self, requests: list[Request], error: str) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            if request.status == RUNNING:
                request.error = error
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(make_output(request, [], None))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RUNNING:
            self.running.remove(request)
            self.lora.stop(request)
        else:
            self.waiting.remove(request)
        self.lora.finish(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self.handles.release(request)

    # ----------------------------------------------------------------- worker loss, integrity
    def preempt_all(self) -> None:
        """The worker is gone: every running request is preempted (keeps its output) and waits for a new one.

        The new worker's KV cache is empty, so every prefix-cache key is dropped too, and results of plans in
        flight are ignored when (if) they arrive.
        """
        for request in reversed(list(self.running)):        # worst first: the best ends up at the front
            self._preempt(request, StepPlan(step_id=-1))    # a throwaway plan: no worker to tell
        self.handles.worker_lost()
        self.lora.worker_lost()
        self.kv.reset_prefix_cache()
        self._in_flight.clear()
        if self.pacer is not None:
            self.pacer.forget_in_flight()
        self._first_live_step = self._next_step_id

    def drain_requests(self) -> list[Request]:
        """Take every unfinished request out (blocks freed, to be recomputed), best first, for a new scheduler.

        Used when a worker with a different KV pool attaches; the caller re-adds them elsewhere.
        """
        self.preempt_all()
        drained = list(self.waiting)
        for request in drained:
            request.status = RequestStatus.WAITING
        self.waiting.clear()
        self.requests.clear()
        self.handles.by_handle.clear()
        return drained

    def check_integrity(self) -> None:
        """Every invariant of queues, counters and blocks; tests call it after every step."""
        check_scheduler(self)
        self.lora.check(list(self.running))
