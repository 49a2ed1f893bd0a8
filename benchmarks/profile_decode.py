"""Where a 64-concurrent decode step's time goes in the worker (CPU): python -m benchmarks.profile_decode

Admits 64 requests (128-token prompts) into an in-process ModelRunner, runs their prefill, then times decode-only
steps split into phases (plan -> inputs, forward, logits, sampling; forward split into linear layers, attention
and the rest with STEPLOOP_CPU_DECODER=0, which keeps the layer-by-layer path) and runs torch.profiler over a few
steps. Prints the phase table and the top operators by self CPU time; writes benchmarks/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from benchmarks.inprocess import InProcessEngine
from steploop.bench import datasets
from steploop.common.model_path import resolve_model
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request

RESULTS = pathlib.Path(__file__).parent / "results" / "profile_decode.json"


def _phase_timer(runner):
    """Wrap the runner's pieces to time them (monkeypatching instance attributes only)."""
    import steploop.gpu_worker.model_runner as mr
    times: dict[str, list[float]] = {"inputs": [], "forward": [], "logits": [], "sample": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            times[name].append(time.perf_counter() - t)
            return out
        return wrapper

    if hasattr(runner, "prepare_step"):    # inputs, attention tiles and sampling rows: one staged copy
        runner.prepare_step = timed("inputs", runner.prepare_step)
    else:                                  # before the staging buffer (for comparing against older commits)
        mr.prepare_step_inputs = timed("inputs", mr.prepare_step_inputs)
    runner.model.forward = timed("forward", runner.model.forward)
    # inside forward, on the layer-by-layer path: every linear layer but lm_head, and attention (summed per step)
    times["forward: linear layers"], times["forward: attention"] = [], []
    for module in runner.model.model.modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            module.forward = timed("forward: linear layers", module.forward)
    backend = runner.model.backend
    backend.forward = timed("forward: attention", backend.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler = timed("sample", runner.sampler)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None, help="a model folder or GGUF file (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args(argv)
    engine = InProcessEngine(resolve_model(args.model), 2048, num_threads=args.threads)
    runner, sched = engine.runner, engine._new_scheduler()
    tok = datasets.load_tokenizer(None)
    for i, r in enumerate(datasets.random_dataset(args.batch, args.prompt_len, 10_000, 0.0, tok, seed=5, as_ids=True)):
        sched.add_request(Request(f"r{i}", r.prompt,
                                  sampling=SamplingParams(max_tokens=4 * args.steps + 16, ignore_eos=True)))
    while sched.num_waiting or _prefilling(sched):
        plan = sched.schedule()
        sched.update_from_output(plan, runner.execute(plan))
    times = _phase_timer(runner)
    step_times = []
    for _ in range(args.steps):
        plan = sched.schedule()
        t = time.perf_counter()
        result = runner.execute(plan)
        step_times.append(time.perf_counter() - t)
        sched.update_from_output(plan, result)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            plan = sched.schedule()
            sched.update_from_output(plan, runner.execute(plan))
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)
    step = statistics.median(step_times)
    layers = runner.model.config.num_hidden_layers
    per_step = {"forward: linear layers": 4 * layers, "forward: attention": layers}     # calls per step
    phases = {k: statistics.median(v) * 1000 * per_step.get(k, 1) for k, v in times.items() if v}
    inner = sum(v for k, v in phases.items() if k.startswith("forward: "))
    if inner:          # the layer-by-layer path; the C decoder (cpu_kernels/decoder.c) runs all layers in one call
        phases["forward: rest (norms, rotary, KV write, silu, python)"] = phases["forward"] - inner
    phases["other (apply_plan, record, python)"] = step * 1000 - sum(v for k, v in phases.items()
                                                                      if not k.startswith("forward: "))
    print(f"decode step, {args.batch} requests: median {step * 1000:.1f} ms ({args.batch / step:.0f} tok/s)")
    for k, v in phases.items():
        print(f"  {k:<40}{v:8.1f} ms {v / (step * 1000):6.1%}")
    top = [{"op": e.key, "shapes": str(e.input_shapes), "self_cpu_ms_per_step": e.self_cpu_time_total / 3000,
            "calls_per_step": e.count / 3}
           for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:20]]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"batch": args.batch, "threads": torch.get_num_threads(),
                                   "median_step_ms": step * 1000, "phases_ms": phases, "top_ops": top}, indent=2))
    print(f"wrote {RESULTS}")


def _prefilling(sched) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)


if __name__ == "__main__":
    main()
