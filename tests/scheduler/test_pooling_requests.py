"""Embedding (pooling) requests in the scheduler: prompt-only, batched and chunked like prompt chunks, finished
with the worker's vector once the whole prompt is computed, sharing the prefix cache when the pooling allows
(LAST) and taking no hits when it needs every position (MEAN, CLS). Invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from steploop.common.pooling_params import PoolingConfig, PoolingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus
from tests.scheduler.sched_factories import create_requests, create_scheduler

LAST = PoolingConfig("LAST", True, 8)
MEAN = PoolingConfig("MEAN", True, 8)


def pooling_scheduler(pooling: PoolingConfig, budget: int = 16, async_scheduling: bool = False,
                      max_model_len: int = 1024, num_blocks: int = 400, policy: str = "fcfs"):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, async_scheduling=async_scheduling,
                             scheduling_policy=policy)
    kv = KVCacheManager(num_blocks, 4, config.enable_prefix_caching)
    return make_scheduler(config, kv, max_model_len, (2,), pooling)


def vector_of(prompt: list[int]) -> list[float]:
    return [float(sum(prompt)), float(len(prompt))]


class PoolingWorker:
    """Tracks each request's computed positions from plan deltas; a request whose chunk reaches its prompt's end
    gets vector_of(prompt). Records the first position each request (per admission) computes."""

    def __init__(self) -> None:
        self.held: dict[int, list] = {}          # handle -> [prompt, num_computed]
        self.first_positions: list[tuple[int, int]] = []   # (prompt length, first computed position)

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished_handles + plan.preempted_handles:
            self.held.pop(handle)
        for new in plan.new_requests:
            assert new.pooling is not None and not new.output_token_ids
            self.held[new.handle] = [new.prompt_token_ids, new.num_computed_tokens]
            self.first_positions.append((len(new.prompt_token_ids), new.num_computed_tokens))
        for handle, computed in zip(plan.cached.handles, plan.cached.num_computed_tokens):
            self.held[handle][1] = computed
        result = StepResult(step_id=plan.step_id)
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            state = self.held[handle]
            state[1] += n
            assert state[1] <= len(state[0]), "scheduled past the prompt"
            if state[1] == len(state[0]):
                result.pooled[handle] = vector_of(state[0])
        return result


def run(sched, requests: list[Request], worker: PoolingWorker, max_steps: int = 500,
        late: tuple[int, list[Request]] = (0, [])) -> dict:
    """Add `requests`, then late[1] before step late[0], and step until every one finished."""
    for request in requests:
        sched.add_request(request)
    outputs, pending = {}, []
    for i in range(max_steps):
        if i == late[0]:
            for request in late[1]:
                sched.add_request(request)
        if not sched.has_unfinished_requests() and not pending:
            break
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        pending.append((plan, worker.execute(plan)))
        if not sched.config.async_scheduling or len(pending) > 1 or not sched.has_unfinished_requests():
            done_plan, result = pending.pop(0)
            for out in sched.update_from_output(done_plan, result):
                assert out.request_id not in outputs, "a pooling request finished twice"
                outputs[out.request_id] = out
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks, "blocks leaked"
    return outputs


def pooling_requests(num: int, seed: int, prefix_len: int = 12, prefix: str = "emb") -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(prefix_len)]
    return [Request(request_id=f"{prefix}-{i}", pooling=PoolingParams(),
                    prompt_token_ids=shared + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 40))])
            for i in range(num)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("budget", [8, 16, 512])
def test_pooling_requests_finish_once_with_their_vector(budget, async_scheduling):
    sched, worker = pooling_scheduler(LAST, budget, async_scheduling), PoolingWorker()
    requests = pooling_requests(12, seed=budget)
    outputs = run(sched, requests, worker)
    for request in requests:
        out = outputs[request.request_id]
        assert out.finish_reason == RequestStatus.FINISHED_STOPPED and out.new_token_ids == []
        assert out.embedding == vector_of(request.prompt_token_ids)
        assert (out.num_prompt_tokens, out.num_output_tokens) == (len(request.prompt_token_ids), 0)


def test_last_token_pooling_shares_the_prefix_cache_and_computes_the_last_token():
    sched, worker = pooling_scheduler(LAST, budget=64), PoolingWorker()
    first = pooling_requests(4, seed=1)
    run(sched, first, worker)
    again = [Request(request_id=f"again-{i}", prompt_token_ids=list(r.prompt_token_ids), pooling=PoolingParams())
             for i, r in enumerate(first)]
    outputs = run(sched, again, worker)
    for request in again:
        out = outputs[request.request_id]
        assert out.embedding == vector_of(request.prompt_token_ids)
        assert out.num_cached_tokens > 0              # the hit was taken...
    assert all(start < n for n, start in worker.first_positions)   # ...and the last token still computed


def test_mean_pooling_takes_no_prefix_hits():
    sched, worker = pooling_scheduler(MEAN, budget=64), PoolingWorker()
    first = pooling_requests(4, seed=2)
    run(sched, first + [Request(request_id=f"again-{i}", prompt_token_ids=list(r.prompt_token_ids),
                                pooling=PoolingParams()) for i, r in enumerate(first)], worker)
    assert all(start == 0 for _, start in worker.first_positions)


def test_a_pooling_prompt_may_fill_the_context_but_not_more():
    sched, worker = pooling_scheduler(LAST, budget=16, max_model_len=32), PoolingWorker()
    fits = Request(request_id="fits", prompt_token_ids=list(range(10, 42)), pooling=PoolingParams())
    assert run(sched, [fits], worker)["fits"].embedding == vector_of(fits.prompt_token_ids)
    with pytest.raises(RequestRejectedError, match="maximum context length is 32 tokens.*33 tokens") as err:
        sched.add_request(Request(request_id="long", prompt_token_ids=list(range(10, 43)), pooling=PoolingParams()))
    assert err.value.code == "context_length_exceeded"


def test_runner_mismatch_is_refused_both_ways():
    with pytest.raises(RequestRejectedError, match="The model does not support Embeddings API"):
        create_scheduler().add_request(Request(request_id="e", prompt_token_ids=[11, 12], pooling=PoolingParams()))
    with pytest.raises(RequestRejectedError, match="does not support generation"):
        pooling_scheduler(LAST).add_request(create_requests(1)[0])


def test_dimensions_need_a_matryoshka_model():
    with pytest.raises(RequestRejectedError, match="does not support matryoshka representation"):
        pooling_scheduler(LAST).add_request(Request(request_id="d", prompt_token_ids=[11, 12],
                                                    pooling=PoolingParams(dimensions=4)))
    only = PoolingConfig("LAST", True, 8, True, (4, 8))
    with pytest.raises(RequestRejectedError, match=r"only supports \[4, 8\] matryoshka dimensions"):
        pooling_scheduler(only).add_request(Request(request_id="d", prompt_token_ids=[11, 12],
                                                    pooling=PoolingParams(dimensions=5)))
    pooling_scheduler(only).add_request(Request(request_id="d", prompt_token_ids=[11, 12],
                                                pooling=PoolingParams(dimensions=4)))



@pytest.mark.parametrize("pooling", [LAST, MEAN], ids=["last", "mean"])
def test_preempted_pooling_requests_are_recomputed_to_the_same_vector(pooling):
    # Admission keeps room for every admitted prompt, so pooling requests (no decode growth) preempt nobody by
    # growing: here better-priority prompts arrive while worse ones are mid-prompt in 15 usable blocks of 4
    # tokens, and preempt them (async scheduling: with a plan in flight).
    sched = pooling_scheduler(pooling, budget=24, async_scheduling=True, num_blocks=16, policy="priority")
    worker = PoolingWorker()
    rng = random.Random(7)
    requests = [Request(request_id=f"emb-{i}", pooling=PoolingParams(), priority=int(i < 3),
                        prompt_token_ids=[rng.randrange(10, 1000) for _ in range((40, 28)[i >= 3])])
                for i in range(6)]
    outputs = run(sched, requests[:3], worker, late=(1, requests[3:]))
    assert sched.num_preemptions > 0
    for request in requests:
        assert outputs[request.request_id].embedding == vector_of(request.prompt_token_ids)
    if pooling is MEAN:
        assert all(start == 0 for _, start in worker.first_positions)   # recomputed from the first position
