"""The scheduler's inline fast paths (plain decodes in _schedule_running and _apply_tokens, in Python and in C:
services/scheduler/fastpath) against the general path: over random workloads (sync/async, drafts, prefix cache,
priority, pacing, small pools), a scheduler whose every request goes through _num_new_tokens / allocate_slots /
_add_to_batch / _advance and _append_tokens must build byte-identical plans and equal outputs, step for step."""

from __future__ import annotations

import random
import types

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step_contract import StepResult
from services.scheduler import fastpath
from services.scheduler.request import Request, RequestRejectedError
from tests.scheduler.sched_factories import FakeWorker, create_scheduler


def general_schedule_running(self, plan, budget, scheduled, ends):
    """_schedule_running without its inline decode path: every request through the general calls."""
    running, i = self.running, 0
    while i < len(running) and budget > 0:
        request = running[i]
        num_new = self._num_new_tokens(request, budget)
        if num_new <= 0:
            i += 1
            continue
        computed = request.num_computed_tokens
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return budget
        if new_blocks:
            plan.cached.append(request.handle, computed, new_blocks)
        self._add_to_batch(plan, request, num_new)
        scheduled.append(request)
        ends.append(self._advance(plan, request, num_new))
        budget -= num_new
        i += 1
    return budget


def general_apply_tokens(self, in_flight, plan, sampled):
    """_apply_tokens without its inline path: every sampled request through _append_tokens."""
    return self._apply_results(in_flight, plan, StepResult(step_id=plan.step_id, sampled=sampled))


def random_config(rng: random.Random) -> dict:
    return dict(max_num_batched_tokens=rng.choice([8, 16, 64, 256]), max_num_seqs=rng.choice([2, 4, 8]),
                num_blocks=rng.choice([12, 30, 200]), block_size=rng.choice([2, 4]),
                max_model_len=rng.choice([48, 1024]), async_scheduling=rng.random() < 0.5,
                long_prefill_token_threshold=rng.choice([0, 0, 6]), scheduling_policy=rng.choice(["fcfs", "priority"]),
                enable_prefix_caching=rng.random() < 0.7, num_speculative_tokens=rng.choice([0, 0, 2]),
                max_decode_slowdown=rng.choice([0.0, 2.0]), admission_watermark=rng.choice([0.0, 0.05]))


def random_request(rng: random.Random, i: int, base: list[int], max_model_len: int) -> Request:
    prompt = base[:rng.choice([0, 4, 8])] + [rng.randrange(10, 990) for _ in range(rng.randint(1, 20))]
    sampling = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.5,
                              stop_token_ids=tuple(rng.sample(range(10, 990), 3)) if rng.random() < 0.2 else (),
                              min_tokens=rng.choice([0, 0, 2]), prompt_logprobs=rng.choice([-1, -1, -1, 0]))
    return Request(f"r{i}", prompt[:max_model_len - 2], sampling=sampling, priority=rng.randint(0, 2),
                   arrival_time=float(i))


def run_workload(seed: int, general: bool, c_loops: bool = False, scale: int = 1) -> list:
    """Every serialized plan and every output of one random workload, in order. c_loops: the fast paths' plain
    decodes run in C; scale: that many times the requests and max_num_seqs (long runs of plain decodes)."""
    rng = random.Random(seed)
    config = random_config(rng)
    config["max_num_seqs"] *= scale
    config["num_blocks"] *= scale
    config["max_num_batched_tokens"] = max(config["max_num_batched_tokens"], config["max_num_seqs"])
    sched = create_scheduler(**config)
    sched.c_loops = fastpath.load() if c_loops else None
    assert not c_loops or sched.c_loops is not None
    if general:
        sched._schedule_running = types.MethodType(general_schedule_running, sched)
        sched._apply_tokens = types.MethodType(general_apply_tokens, sched)
    worker, trace, in_flight = FakeWorker(block_size=config["block_size"]), [], []
    base = [rng.randrange(10, 990) for _ in range(16)]
    window = 2 if config["async_scheduling"] else 1
    for i in range(rng.randint(20, 80)):
        for j in range(rng.choice([0, 0, 1, 3]) * scale):
            try:
                sched.add_request(random_request(rng, 1000 * i + j, base, config["max_model_len"]))
            except RequestRejectedError as e:       # too long for a small pool: refused the same on both paths
                trace.append(str(e))
        if rng.random() < 0.05 and sched.requests:
            trace.extend(sched.abort_requests([rng.choice(sorted(sched.requests))]))
        if not sched.has_unfinished_requests() and not in_flight:
            continue
        plan = sched.schedule()
        trace.append(plan.to_pb().SerializeToString())
        in_flight.append((plan, worker.execute(plan)))
        while len(in_flight) >= window or (in_flight and not sched.has_unfinished_requests()):
            trace.extend(sched.update_from_output(*in_flight.pop(0)))
        sched.check_integrity()
    return trace


@pytest.mark.parametrize("c_loops", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("seeds", [range(40), range(40, 80)])
def test_fast_paths_build_the_plans_and_outputs_of_the_general_path(seeds, c_loops):
    for seed in seeds:
        assert run_workload(seed, general=False, c_loops=c_loops) == run_workload(seed, general=True), \
            f"workload {seed}"


@pytest.mark.parametrize("seed", range(6))
def test_c_loops_on_many_requests(seed):
    """Long runs of plain decodes (8-64 running) with every feature the random configs draw."""
    assert run_workload(seed, general=False, c_loops=True, scale=8) == run_workload(seed, general=True, scale=8)


def test_c_loops_build_where_gcc_is():
    """Where gcc and Python's headers are (CI, the worker image), the scheduler gets its C loops; a disabled or
    unbuildable extension leaves it on the Python loops."""
    import shutil
    import sysconfig
    from pathlib import Path

    if shutil.which("gcc") and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert fastpath.load() is not None
        assert create_scheduler().c_loops is not None
