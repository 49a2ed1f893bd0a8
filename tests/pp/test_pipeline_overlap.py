"""-pp 2 with the stages overlapping: the real PipelineScheduler keeps one plan per stage in flight (disjoint
batches) over a group of ModelRunners (one thread per rank, real gloo groups: pp_ranks.py), as the engine loop does.
Greedy tokens equal transformers' generate and every logprob is within 1e-4, with whole prompts, chunked prefill and
preemption, for a dense Llama at -pp 2 and Mixtral at -tp 2 -pp 2; the first stage runs plan N + 1 while the last
stage still runs plan N."""

from __future__ import annotations

from collections import deque

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request
from tests.pp.pp_ranks import PipelineGroup
from tests.worker.test_families import NEW_TOKENS, prompts

# (max_num_batched_tokens, long_prefill_token_threshold, KV blocks the scheduler may use incl. the null block)
# "preempting": admission keeps room for every admitted prompt and these decodes do not outgrow their blocks, so the
# last prompt arrives late with a better priority and preempts a running one.
SCHEDULES = {"whole-prompts": (512, 0, 64), "chunked": (24, 7, 64), "preempting": (64, 0, 11)}
LATE_BETTER = {"preempting"}


def serve_overlapped(group: PipelineGroup, budget: int, threshold: int, num_blocks: int, late_better: bool = False):
    """Every prompt through the scheduler with `pp` plans in flight; (tokens, logprobs) per prompt, and the number
    of preemptions. `late_better`: priority policy, the last prompt added after 3 plans with a better priority."""
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, long_prefill_token_threshold=threshold,
                             scheduling_policy="priority" if late_better else "fcfs")
    kv = KVCacheManager(num_blocks, group.block_size, config.enable_prefix_caching)
    sched = make_scheduler(config, kv, group.info.max_model_len,
                           [], pipeline_parallel_size=2)
    sampling = SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [Request(request_id=str(i), prompt_token_ids=prompt, sampling=sampling, priority=1)
                for i, prompt in enumerate(prompts())]
    late = [requests.pop()] if late_better else []
    for request in requests:
        sched.add_request(request)
    got = {str(i): ([], []) for i in range(len(prompts()))}
    out: deque = deque()
    for i in range(500):
        if i == 3:
            for request in late:
                request.priority = 0
                sched.add_request(request)
        if not (sched.has_unfinished_requests() or out or i < 3 and late):
            break
        sent = False
        if len(out) < 2 and sched.has_unfinished_requests():
            plan = sched.schedule()
            if plan.scheduled_handles or plan.finished_handles or plan.preempted_handles:
                group.submit(plan)
                out.append(plan)
                sent = True
        if out and (len(out) == 2 or not sent):
            plan = out.popleft()
            for o in sched.update_from_output(plan, group.collect(plan)):
                got[o.request_id][0].extend(o.new_token_ids)
                got[o.request_id][1].extend(lp.logprob for lp in o.logprobs or [])
            sched.check_integrity()
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    group.reset()
    return [got[str(i)] for i in range(len(prompts()))], sched.num_preemptions


def overlapped_once(spans, tp: int) -> bool:
    """Some plan N + 1 began on stage 0 (rank 0) before plan N ended on stage 1 (rank tp, its tp rank 0)."""
    ends = {step: ended for rank, step, _, ended in spans if rank == tp}
    return any(rank == 0 and step - 1 in ends and began < ends[step - 1] for rank, step, began, _ in spans)


# a dense model at -pp 2 in the fast suite; a mixture of experts at -tp 2 -pp 2 (four ranks) in the slow one
CASES = [pytest.param("llama", 1, schedule, id=f"llama-tp1-{schedule}") for schedule in SCHEDULES] + [
    pytest.param("mixtral", 2, schedule, id=f"mixtral-tp2-{schedule}", marks=pytest.mark.slow)
    for schedule in SCHEDULES]


@pytest.mark.parametrize("name, tp, schedule", CASES)
def test_overlapped_stages_equal_transformers(models, name, tp, schedule):
    path, expected = models(name)
    group = PipelineGroup(path, tp, 2)
    try:
        got, preemptions = serve_overlapped(group, *SCHEDULES[schedule], late_better=schedule in LATE_BETTER)
        for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, expected)):
            where = f"{name} -tp {tp} -pp 2 {schedule} prompt {i}"
            assert tokens == want_tokens, f"{where}: {tokens} != {want_tokens}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), where
        assert (preemptions > 0) == (schedule == "preempting")
        assert overlapped_once(group.spans, tp), "stage 0 never ran a plan while stage 1 ran the one before"
    finally:
        group.close()
