"""Adapters as a step resource in the transport-free scheduler: at most max_loras distinct adapters run, the
plan names each adapter's folder once per worker and drops unloaded ones, prefix-cache hits never cross
adapters, and under the priority policy a better request preempts a worse adapter's requests for a seat."""

from __future__ import annotations

import pytest

from steploop.common.lora_config import LoraModule
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.lora_steps import LoraSteps
from tests.scheduler.sched_factories import FakeWorker, Run, create_requests, expected_output, run_until_idle, step


def lora_scheduler(max_loras: int, unloaded: set[str] | None = None, **config):
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, async_scheduling=False,
                             admission_watermark=0.0, **config)
    kv = KVCacheManager(1000, 4, config.enable_prefix_caching)
    return make_scheduler(config, kv, 1024, (2,), lora=LoraSteps(max_loras, unloaded))


def with_adapters(requests, names):
    for request, name in zip(requests, names):
        request.lora_name, request.lora_path = (name, f"/adapters/{name}") if name else (None, "")
    return requests


class AdapterWorker(FakeWorker):
    """The fake worker, also checking what a real one needs: an adapter's folder before its first request."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: dict[str, str] = {}
        self.adapter_of: dict[int, str] = {}
        self.max_in_step = 0

    def execute(self, plan):
        for name in plan.lora_drops:
            self.registered.pop(name)
        for module in plan.lora_loads:
            assert module.name not in self.registered, f"{module.name} sent twice"
            self.registered[module.name] = module.path
        for new in plan.new_requests:
            if new.lora_name:
                assert new.lora_name in self.registered, f"{new.lora_name} used before its folder was sent"
                self.adapter_of[new.handle] = new.lora_name
        in_step = {self.adapter_of[h] for h in plan.scheduled_handles if h in self.adapter_of}
        self.max_in_step = max(self.max_in_step, len(in_step))
        for handle in plan.finished_handles + plan.preempted_handles:
            self.adapter_of.pop(handle, None)
        return super().execute(plan)


@pytest.mark.parametrize("max_loras", [1, 2, 3])
def test_at_most_max_loras_adapters_run_and_every_request_finishes_as_alone(max_loras):
    sched = lora_scheduler(max_loras)
    requests = with_adapters(create_requests(12, prompt_len=[5 + i for i in range(12)], max_tokens=6),
                             ["a", "b", "c", None] * 3)
    for request in requests:
        sched.add_request(request)
    worker = AdapterWorker()
    run = run_until_idle(sched, worker)
    assert worker.max_in_step == max_loras
    assert set(worker.registered) == {"a", "b", "c"}
    for request in requests:
        assert run.tokens[request.request_id] == expected_output(request)[0]


def test_an_unloaded_adapter_is_dropped_once_no_request_uses_it():
    unloaded: set[str] = set()
    sched = lora_scheduler(2, unloaded)
    first = with_adapters(create_requests(2, max_tokens=4, prefix="one"), ["a", "b"])
    for request in first:
        sched.add_request(request)
    worker, run = AdapterWorker(), Run()
    step(sched, worker, run)
    unloaded.add("a")                  # unload_lora_adapter while its request runs
    plan = step(sched, worker, run)
    assert plan.lora_drops == []       # still in use
    run_until_idle(sched, worker, run)
    later = with_adapters(create_requests(1, max_tokens=2, prefix="two"), [None])[0]
    sched.add_request(later)
    plan = step(sched, worker, run)
    assert plan.lora_drops == ["a"] and "a" not in worker.registered and unloaded == set()
    run_until_idle(sched, worker, run)


def test_prefix_cache_hits_never_cross_adapters():
    sched = lora_scheduler(2)
    worker, run = AdapterWorker(), Run()
    prompt = list(range(20, 52))       # 8 full blocks of 4
    hits = {}
    for i, name in enumerate(["a", "a", "b", None, "b"]):
        request = with_adapters(create_requests(1, max_tokens=2, prefix=f"r{i}"), [name])[0]
        request.prompt_token_ids = list(prompt)
        sched.add_request(request)
        run_until_idle(sched, worker, run)
        hits[i] = request.num_cached_tokens
    assert hits == {0: 0, 1: 28, 2: 0, 3: 0, 4: 28}


def test_priority_preempts_a_worse_adapter_for_a_seat():
    sched = lora_scheduler(1, scheduling_policy="priority")
    worker, run = AdapterWorker(), Run()
    low = with_adapters(create_requests(2, max_tokens=30, prefix="low", priority=5), ["a", "a"])
    for request in low:
        sched.add_request(request)
    step(sched, worker, run)
    high = with_adapters(create_requests(1, max_tokens=3, prefix="high", priority=0), ["b"])[0]
    sched.add_request(high)
    plan = step(sched, worker, run)
    assert sorted(plan.preempted_handles) == sorted(r.handle for r in low)
    run_until_idle(sched, worker, run)
    assert run.tokens[high.request_id] == expected_output(high)[0]
    for request in low:
        assert run.tokens[request.request_id] == expected_output(request)[0]


def test_fcfs_never_preempts_for_an_adapter_it_waits():
    sched = lora_scheduler(1)
    worker, run = AdapterWorker(), Run()
    first = with_adapters(create_requests(1, max_tokens=5, prefix="a"), ["a"])[0]
    sched.add_request(first)
    step(sched, worker, run)
    second = with_adapters(create_requests(1, max_tokens=5, prefix="b"), ["b"])[0]
    base = with_adapters(create_requests(1, max_tokens=5, prefix="base"), [None])[0]
    sched.add_request(second)
    sched.add_request(base)
    plan = step(sched, worker, run)
    assert not plan.preempted_handles
    assert [n.handle for n in plan.new_requests] == [base.handle]   # the base request overtakes the waiting one
    run_until_idle(sched, worker, run)
    assert LoraModule("b", "/adapters/b") in [m for p in run.plans for m in p.lora_loads]
