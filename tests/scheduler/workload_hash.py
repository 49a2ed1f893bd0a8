"""One hash over the serialized plans and outputs of 300 random scheduler workloads:

    python -m tests.scheduler.workload_hash [--workloads 300]

A refactor of the scheduler that must not change behaviour prints the same hash before and after (record it at
the base commit first). Each workload draws a config (sync/async, n-gram drafts, prefix cache, priority, prefill
pacing with a timed fake worker, LoRA seats, small pools, chunking thresholds) and a stream of requests (shared
prefixes, stop ids, min_tokens, EOS hits, prompt logprobs, resumed outputs, cache salts, adapters), with aborts,
failed steps and lost workers, and runs it twice: with the scheduler's C loops and with its Python path only.
Both runs must give the same trace (checked here); the hash covers every plan (deterministic protobuf bytes),
every RequestOutput, every refusal and the scheduler's counters at the end. Only the public Scheduler API is used,
so the script runs unchanged on either side of a refactor.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler import fastpath
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.lora_steps import LoraSteps
from steploop.scheduler.request import Request, RequestRejectedError
from tests.scheduler.sched_factories import EOS, FakeWorker, fake_model

ADAPTERS = ("a", "b", "c")


def chatty_model(tokens: list[int]) -> int:
    """fake_model, but EOS now and then and a small vocabulary, so stop ids and EOS end requests too."""
    t = fake_model(tokens)
    return EOS if t % 11 == 0 else 10 + t % 40


def random_scheduler(rng: random.Random, scale: int):
    max_num_seqs = rng.choice([1, 2, 4, 8]) * scale
    config = SchedulerConfig(
        max_num_batched_tokens=max(rng.choice([4, 8, 16, 64, 256]), max_num_seqs), max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=rng.choice([0, 0, 6, 32]), scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5,
        num_speculative_tokens=rng.choice([0, 0, 2, 3]), max_decode_slowdown=rng.choice([0.0, 0.0, 1.5, 3.0]),
        admission_watermark=rng.choice([0.0, 0.05]))
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = -(-rng.choice([60, 120, 400, 4000]) // block_size) * scale     # tokens the pool holds, in blocks
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
    max_model_len = rng.choice([48, 96, 1024])
    lora = LoraSteps(rng.choice([1, 2])) if rng.random() < 0.3 else None
    return make_scheduler(config, kv, max_model_len, (EOS,), lora=lora), lora is not None


def random_request(rng: random.Random, rid: str, base: list[int], max_model_len: int, lora: bool) -> Request:
    prompt = base[:rng.choice([0, 0, 4, 8, 16])] + [rng.randrange(10, 50) for _ in range(rng.choice([1, 3, 9, 30]))]
    prompt = prompt[:max_model_len - 4]
    resumed = [rng.randrange(10, 50) for _ in range(rng.choice([0, 0, 0, 0, 2]))]
    prompt_logprobs = -1 if resumed else rng.choice([-1, -1, -1, -1, 0])
    sampling = SamplingParams(max_tokens=None if rng.random() < 0.15 else rng.randint(3, 30), min_tokens=rng.choice([0, 0, 2]),
                              ignore_eos=rng.random() < 0.3, prompt_logprobs=prompt_logprobs,
                              stop_token_ids=tuple(rng.sample(range(10, 50), rng.choice([0, 0, 1, 3]))))
    adapter = rng.choice(ADAPTERS + (None,)) if lora else None
    return Request(rid, prompt, output_token_ids=resumed, sampling=sampling, priority=rng.randint(0, 2),
                   arrival_time=float(len(rid)), cache_salt=rng.choice([None, None, "s"]), lora_name=adapter,
                   lora_path=f"/adapters/{adapter}" if adapter else "")


def run_workload(seed: int, c_loops: bool) -> list:
    """The trace of one workload: serialized plans, outputs and refusals in order, then the counters."""
    rng = random.Random(seed)
    scale = 8 if seed % 10 == 9 else 1            # every tenth: long runs of plain decodes
    sched, lora = random_scheduler(rng, scale)
    if not c_loops:
        sched.c_loops = None
    elif sched.c_loops is None:
        raise SystemExit("the scheduler's C loops are not built (gcc and Python.h needed)")
    worker, trace, in_flight = FakeWorker(block_size=sched.kv.block_size, model=chatty_model), [], []
    window = 2 if sched.config.async_scheduling else 1
    base = [rng.randrange(10, 50) for _ in range(16)]
    for i in range(rng.randint(30, 90)):
        for j in range(rng.choice([0, 0, 1, 3]) * scale):
            try:
                sched.add_request(random_request(rng, f"r{i}.{j}", base, sched.max_model_len, lora))
            except RequestRejectedError as e:
                trace.append(f"rejected {e.code} {e.param}: {e}")
        if rng.random() < 0.05 and sched.requests:
            trace.extend(map(repr, sched.abort_requests(rng.sample(sorted(sched.requests), 1))))
        if rng.random() < 0.02:                   # the worker is lost: plans in flight never answer
            in_flight.clear()
            sched.preempt_all()
            worker = FakeWorker(block_size=sched.kv.block_size, model=chatty_model)
            trace.append("worker lost")
        if not sched.has_unfinished_requests() and not in_flight:
            continue
        plan = sched.schedule()
        trace.append(plan.to_pb().SerializeToString(deterministic=True))
        worker.fail_steps = {plan.step_id} if rng.random() < 0.02 else set()
        result = worker.execute(plan)
        result.forward_seconds = 0.01 + 1e-4 * plan.total_num_scheduled_tokens   # the pacer learns from it
        in_flight.append((plan, result))
        while len(in_flight) >= window or (in_flight and not sched.has_unfinished_requests()):
            trace.extend(map(repr, sched.update_from_output(*in_flight.pop(0))))
        sched.check_integrity()
    trace.append(repr(sched.counters()))
    return trace


def digest(trace: list) -> bytes:
    h = hashlib.sha256()
    for item in trace:
        data = item if isinstance(item, bytes) else item.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=300)
    args = parser.parse_args()
    if fastpath.load() is None:
        raise SystemExit("the scheduler's C loops are not built (gcc and Python.h needed)")
    total, items = hashlib.sha256(), 0
    for seed in range(args.workloads):
        c_trace, py_trace = run_workload(seed, c_loops=True), run_workload(seed, c_loops=False)
        if c_trace != py_trace:
            sys.exit(f"workload {seed}: the C loops and the Python path disagree")
        total.update(digest(c_trace))
        items += len(c_trace)
    print(f"{args.workloads} workloads, {items} plans/outputs: sha256 {total.hexdigest()}")


if __name__ == "__main__":
    main()
