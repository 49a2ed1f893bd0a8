"""Scheduler: queues, one token budget per step, preemption by recompute, stop conditions on token ids.

Transport-free: no gRPC, no torch, no asyncio. The step loop (engine_loop.py) calls `schedule()`, ships the
StepPlan to a worker, and feeds the StepResult back through `update_from_output()`. This class holds the state,
the requests' way in and out, and the hooks a variant overrides; the passes of a step live beside it:
running_pass.py (drafts and running requests), admission.py (the waiting queue), step_update.py (a step's
result), with policy.py (queue order, victims), kv_cache_manager.py + prefix_cache.py (blocks, hits),
ngram_proposer.py (drafts), handles.py, stop_rule.py (stops), request_outputs.py (outputs, validation) and
fastpath/ (plain decodes in C). async_scheduler.py subclasses this for one plan in flight, pipeline_scheduler.py
for one per pipeline stage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from steploop.common.mm_inputs import check_features
from steploop.common.pooling_params import PoolingConfig
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler import admission, beam_groups, fastpath, policy, running_pass, step_update
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.encoder_budget import EncoderBudget, paced_whole_image
from steploop.scheduler.handles import HandleTable
from steploop.scheduler.integrity import check_scheduler
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.lora_steps import LoraSteps
from steploop.scheduler.ngram_proposer import NgramProposer
from steploop.scheduler.prefill_pacing import PrefillPacer
from steploop.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus
from steploop.scheduler.request_failures import end_failed
from steploop.scheduler.request_outputs import check_runner, make_output, validate_pooling_request, validate_request
from steploop.scheduler.stats import SchedulerCounters, SchedulerStats
from steploop.scheduler.stop_rule import StopRules

log = logging.getLogger(__name__)

RUNNING = RequestStatus.RUNNING


class Scheduler:
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
        # Running requests admitted with a prompt chunk (admission.Promised; stale entries dropped lazily there).
        self.prompting: dict[str, Request] = {}
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
        self.stop_rules = StopRules(self.eos_token_ids, max_model_len)
        # The plain-decode runs of the two hot loops in C (fastpath/decode_loop.c), or None: Python throughout.
        self.c_loops = fastpath.load()
        step_tokens = min(t for t in (config.max_num_batched_tokens, config.long_prefill_token_threshold) if t > 0)
        self.encoder = EncoderBudget(config.encoder_budget, config.encoder_cache_tokens, step_tokens)   # images
        self.encoder.pacer = self.pacer          # encoder slices fit the pacer's allowance too
        self.background_yields = False              # this step: an interactive request waits (schedule())
        self.beam_groups: dict[str, beam_groups.BeamGroup] = {}   # beam search requests by id (beam_groups.py)
        self.beam_ready: list[beam_groups.BeamGroup] = []         # ranked groups the next plan moves on
        self.beam_sends: list[beam_groups.BeamRequest] = []       # beams the next plan sends as new

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Validate the request (RequestRejectedError when it could never run), write its stop rule and queue it.
        An embedding request (request.pooling) is prompt only: its last chunk's result carries the pooled vector."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_runner(request, self.pooling)
        if request.pooling is not None:
            validate_pooling_request(request, self.kv, self.max_model_len, self.pooling)
            request.no_prefix_hits = self.pooling.pools_every_position
        else:
            validate_request(request, self.kv, self.max_model_len)
            request.sends_prompt_logprobs = request.sampling.prompt_logprobs >= 0
        if request.mm_features:
            try:
                check_features(request.mm_features, len(request.prompt_token_ids))
            except ValueError as exc:
                raise RequestRejectedError(str(exc), "invalid_value", "messages") from None
            self.encoder.check(request)
        self.stop_rules.encode(request)
        request.num_prompt = len(request.prompt_token_ids)
        if request.beam is not None:
            if request.pooling is not None or request.request_id in self.beam_groups:
                raise RequestRejectedError("beam search is for generation requests with unique ids", "invalid_value")
            beam_groups.start(self, request)    # its beams are queued, not the request itself
            return
        request.status = RequestStatus.WAITING
        self.handles.assign(request)
        self.lora.add(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish the requests now and free their blocks; the worker hears of it in the next plan."""
        outputs = []
        for request_id in request_ids:
            group = self.beam_groups.get(request_id)
            if group is not None:
                outputs.append(beam_groups.finish(self, group, RequestStatus.FINISHED_ABORTED))
                continue
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
            deferred_prompt_tokens=pacer.num_deferred_tokens if pacer else 0,
            encoder_queries=self.encoder.num_queries, encoder_hits=self.encoder.num_hits,
            images_encoded=self.encoder.num_encoded)

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
        2. Running requests first, best rank first (policy.py; running_pass.py). Each gets `min(gap, budget)`
           tokens where gap = num_tokens_with_spec + num_output_placeholders - num_computed_tokens, clipped to
           `long_prefill_token_threshold` when set and to max_model_len. A long prompt thus runs in chunks over
           several steps (chunked prefill), and a decode is just a gap of 1.
        3. Prefill pacing (`max_decode_slowdown` > 0, prefill_pacing.py): in a step that also decodes, the prompt
           chunks (gap > 1 + drafts), running or waiting, together get at most the tokens whose predicted time
           keeps the step within that ratio of its decodes alone (a cost model learned from the workers' step
           times), and at least one block's worth so prompts progress.
        4. If a running request cannot get blocks for its tokens, preempt the worst running request (last in
           rank, not yet scheduled this step; maybe itself): free its blocks, num_computed_tokens = 0, back to
           the waiting queue; it comes back later as a new request carrying its output tokens (recompute).
        5. Then waiting requests in queue order (admission.py), each starting at its longest cached prefix, while
           budget, max_num_seqs and free blocks (minus the admission watermark) allow; none in a step that
           preempted (the blocks just freed belong to the running requests that needed them). Nobody overtakes
           the head of the queue, except under the LoRA seat rule: at most `max_loras` distinct adapters run at
           once (lora_steps.py), and a request whose adapter has no free seat is set aside for the step while
           the queue goes on. A waiting head of a better class that cannot fit first preempts running requests
           of a worse class (it is admitted next step): background (Batch API) requests under every policy, and
           under the priority policy those of a worse priority, or whose adapter holds the seat it needs.
           While an interactive request waits, running background requests get no prompt chunk (their decodes
           go on): the step's budget goes to the interactive ones first (policy.py).
        6. num_computed_tokens advances by the scheduled count as each request is scheduled, as if the step had
           run (the `_advance` hook), so the next schedule() sees the new gaps.

        Runs of plain decodes in step 2 go through C when the scheduler has its C loops (the
        `_schedule_decodes` hook); the plan is the same either way.
        """
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        if self.beam_ready:                      # ranked beam groups: forks, continuations, dropped beams
            beam_groups.apply_moves(self, plan)
        plan.finished_handles = self.handles.take_finished()
        plan.encoder_free_hashes = self.encoder.take_freed()     # before this step's commits add theirs
        self.encoder.begin_step()
        self.lora.fill_plan(plan)
        if self.beam_sends:
            beam_groups.send_new(self, plan)
        if self.proposer is not None:
            running_pass.propose(self)
        if self.waiting and self.running:
            admission.preempt_for_waiting(self, plan)
        # Background prompt chunks leave this step's budget to interactive requests that wait (policy.py)
        self.background_yields = bool(self.waiting) and not self.waiting.peek().background
        scheduled: list[Request] = []
        ends: list[int] = []                     # num_computed_tokens each scheduled request reaches
        if self.pacer is not None:
            self.pacer.begin_step(len(self.running))
        budget = running_pass.schedule_running(self, plan, self.config.max_num_batched_tokens, scheduled, ends)
        if not plan.preempted_handles:
            admission.schedule_waiting(self, plan, budget, scheduled, ends)
        if scheduled:
            self._in_flight[plan.step_id] = (scheduled, ends)
        elif self.beam_groups and not self._in_flight:
            beam_groups.break_stall(self, plan)
        plan.encoder_slices = self.encoder.take_slices()         # vision-tower layers run before the forward
        if self.pacer is not None:
            self.pacer.end_step(plan.step_id)
        if self.kv.tiers is not None:
            plan.kv_moves = self.kv.tiers.take_moves()
        plan.block_copies = self.kv.take_block_copies()
        self.handles.recycle()
        return plan

    def _add_to_batch(self, plan: StepPlan, request: Request, num_new: int, scheduled: list[Request],
                      ends: list[int]) -> None:
        """Put num_new tokens of the request into the plan, then advance it (`_advance`)."""
        plan.scheduled_handles.append(request.handle)
        plan.num_scheduled_tokens.append(num_new)
        encoded = self.encoder.commit(request, request.num_computed_tokens, num_new) if request.mm_features else 0
        if self.pacer is not None:
            self.pacer.tally(num_new, request.num_computed_tokens + num_new,
                             is_decode=num_new <= 1 + len(request.spec_token_ids), encoder_tokens=encoded)
        if request.spec_token_ids:
            # Drafts are the last tokens of the gap; send those that fall inside this step's tokens.
            known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            if num_new > known:
                plan.draft_token_ids[request.handle] = request.spec_token_ids[:num_new - known]
        scheduled.append(request)
        ends.append(self._advance(plan, request, num_new))

    # ----------------------------------------------------------------- preempt and finish (the passes call these)
    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Recompute it later (`_preempt_one`); a beam's whole group goes (beam_groups.py)."""
        if isinstance(request, beam_groups.BeamRequest):
            if request.status is RUNNING:
                beam_groups.preempt_group(self, request.group, plan)
        else:
            self._preempt_one(request, plan)

    def _preempt_one(self, request: Request, plan: StepPlan) -> None:
        """Recompute it later: blocks freed, back to the front of the waiting queue, its outputs kept."""
        self.kv.free(request)
        self.encoder.release(request)
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

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """It is done (`status` says how), running or waiting: blocks, handle and adapter count go."""
        if request.status == RUNNING:
            self.running.remove(request)
            self.lora.stop(request)
        else:
            self.waiting.remove(request)
        self.lora.finish(request)
        request.status = status
        self.kv.free(request)
        self.encoder.release(request)
        if self.kv.tiers is not None:
            self.kv.tiers.forget(request.request_id)
        del self.requests[request.request_id]
        self.prompting.pop(request.request_id, None)
        self.handles.release(request)

    # ----------------------------------------------------------------- hooks (AsyncScheduler overrides them)
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """min(gap, budget), clipped by the prefill threshold, the context and prefill pacing (schedule() 2-3)."""
        computed = request.num_computed_tokens
        gap = (request.num_prompt + len(request.output_token_ids) + len(request.spec_token_ids)
               + request.num_output_placeholders - computed)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < gap:
            gap = threshold
        # KV is needed for positions < max_model_len - 1 only: sampling from the last position would overflow.
        # An embedding request samples nothing: its prompt may fill the context.
        num_new = min(gap, budget, self.max_model_len - (request.pooling is None) - computed)
        images = request.mm_features and computed < request.mm_features[-1].end
        if self.pacer is not None and gap > 1 + len(request.spec_token_ids):     # a prompt chunk, not a decode
            to_encode = self.encoder.to_encode(request, computed, num_new) if images else []
            # Sliceable: the chunk may stop before an image the allowance does not pay for, and slices finish it.
            # A waiting request too, when text comes before its first such image: admitted with that text, its
            # image is sliced while it runs (a chunk starting at the image would admit nothing, so it stays whole).
            sliceable = self.encoder.depth > 0 and (request.status is RUNNING
                                                     or bool(to_encode) and to_encode[0][0] > computed)
            paced = self.pacer.clip(num_new, computed, to_encode, sliceable=sliceable)
            if images and self.encoder.whole_images:      # Gemma 3: never stuck inside an image while decodes run
                paced = paced_whole_image(request.mm_features, computed, num_new, paced)
            num_new = paced
        if images:                                                # the encoder's budget and cache
            num_new = self.encoder.clip(request, computed, num_new)
        return num_new

    def _wants_drafts(self, request: Request, placeholders: int) -> bool:
        """Only a request in the decode state: its KV covers all but its last token (not mid-prompt); never an
        embedding request (it samples nothing to verify drafts against)."""
        return (request.pooling is None and request.num_computed_tokens == request.num_tokens + placeholders - 1
                and type(request) is not beam_groups.BeamRequest)     # a beam's next token is the ranking's

    def _advance(self, plan: StepPlan, request: Request, num_new: int) -> int:
        """Advance num_computed_tokens by the request's scheduled tokens as if the plan had run (so the next
        schedule() sees the new gap); returns the count it reaches."""
        request.num_computed_tokens += num_new
        return request.num_computed_tokens

    def _schedule_decodes(self, plan: StepPlan, i: int, budget: int, scheduled: list[Request],
                          ends: list[int]) -> tuple[int, int]:
        """The run of plain decodes from running[i], in C, each advanced as `_advance` does; returns (i, budget)
        at the first request it leaves to the Python path (running_pass.c_schedule_decodes)."""
        return running_pass.c_schedule_decodes(self, plan, i, budget, scheduled, ends, frozenset(), False)

    def _on_drafts_verified(self, request: Request) -> None:
        """A step's result says how many of the request's drafts were accepted (async scheduling waits for it)."""

    # ----------------------------------------------------------------- results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, check stops, key newly full blocks, free finished requests (step_update.py).

        Returns one output per request that sampled. Results for requests finished, aborted or preempted since
        the plan was built are dropped (async scheduling relies on it), and so are results of plans sent to a
        worker that was lost since.
        """
        in_flight = self._in_flight.pop(plan.step_id, None)
        if plan.step_id < self._first_live_step:
            return []
        if plan.kv_moves is not None and self.kv.tiers is not None:
            self.kv.tiers.on_result(plan.kv_moves, result.kv_moves, bool(result.error))
        if in_flight is None:
            return []
        if self.pacer is not None:
            self.pacer.observe(plan.step_id, result.forward_seconds)
        requests, ends = in_flight
        if result.error:
            return step_update.fail_requests(self, requests, result.error)
        if result.failed:   # requests the worker cannot serve as asked end alone; the rest go on
            return (end_failed(self, requests, plan.scheduled_handles, result.failed)
                    + step_update.apply_result(self, requests, ends, plan, result))
        return step_update.apply_result(self, requests, ends, plan, result)

    # ----------------------------------------------------------------- worker loss, integrity
    def preempt_all(self) -> None:
        """The worker is gone: every running request is preempted (keeps its output) and waits for a new one.

        The new worker's KV cache is empty, so every prefix-cache key is dropped too, and results of plans in
        flight are ignored when (if) they arrive.
        """
        for request in reversed(list(self.running)):        # worst first: the best ends up at the front
            self._preempt(request, StepPlan(step_id=-1))    # a throwaway plan: no worker to tell
        self.kv.take_block_copies()                         # the copies' worker is gone (children preempted)
        self.handles.worker_lost()
        self.lora.worker_lost()
        self.encoder.reset()
        self.kv.reset_prefix_cache()
        self._in_flight.clear()
        if self.pacer is not None:
            self.pacer.forget_in_flight()
        self._first_live_step = self._next_step_id

    def preempt_running(self) -> StepPlan:
        """Every running request preempted (kept, recomputed later) and every prefix-cache key dropped, with the
        worker still attached: returns the plan that tells it (preempted and finished handles, nothing scheduled).
        For pause(keep) and weight updates (engine_control.py), called with no plan in flight."""
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        plan.finished_handles = self.handles.take_finished()
        for request in reversed(list(self.running)):        # worst first: the best ends up at the front
            self._preempt(request, plan)
        self.kv.take_block_copies()                         # every child preempted: nothing to copy into
        self.kv.reset_prefix_cache()
        self.handles.recycle()
        return plan

    def drain_requests(self) -> list[Request]:
        """Take every unfinished request out (blocks freed, to be recomputed), best first, for a new scheduler.

        Used when a worker with a different KV pool attaches; the caller re-adds them elsewhere.
        """
        self.preempt_all()
        drained = beam_groups.drained(self, list(self.waiting))
        for request in drained:
            request.status = RequestStatus.WAITING
        self.waiting.clear()
        self.requests.clear()
        self.prompting.clear()
        self.handles.by_handle.clear()
        return drained

    def check_integrity(self) -> None:
        """Every invariant of queues, counters and blocks; tests call it after every step."""
        check_scheduler(self)
        self.encoder.check_entries()
        beam_groups.check(self)
        self.lora.check(list(self.running))
