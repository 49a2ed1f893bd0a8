"""What a decode step's preparation costs on the host (no forward): python -m benchmarks.step_prep [--batch 64]

Preparation = everything before the forward that ModelRunner does per step: the step inputs, the attention
backend's metadata (the torch backend: the CPU serving path) and the sampling metadata. A tiny random model with the
default model's vocabulary stands in (the forward is not run). 64 requests with 128-token prompts hold their
blocks; the same decode plan is prepared --reps times and the median printed. Run it from two trees, alternating,
to compare commits (it adapts to the API before and after the staging buffer):

    for i in 1 2; do for t in /tmp/base .; do (cd $t && PYTHONPATH=$t python -m benchmarks.step_prep); done; done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, StepPlan, WorkerInfo
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.model_runner import ModelRunner

VOCAB, BLOCK = 49152, 16


def make_runner(num_blocks: int) -> ModelRunner:
    cfg = LlamaModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg, create_backend("torch", 4, 2, 16, 0.25), 2048)
    caches = [torch.zeros((2, num_blocks, BLOCK, 2, 16))]
    info = WorkerInfo("bench", "bench", BLOCK, num_blocks, 2048, VOCAB, (2,))
    return ModelRunner(model, caches, BLOCK, 2048, info)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompt = 128
    per_req = prompt // BLOCK + 1
    runner = make_runner(args.batch * per_req + 1)
    admit = StepPlan(step_id=0)
    for h in range(args.batch):
        blocks = list(range(1 + h * per_req, 1 + (h + 1) * per_req))
        admit.new_requests.append(NewRequestData(h, list(range(prompt)), [7], SamplingParams(), blocks, prompt))
    runner.batch.apply_plan(admit)
    plan = StepPlan(step_id=1, scheduled_handles=list(range(args.batch)), num_scheduled_tokens=[1] * args.batch)
    backend = runner.model.backend
    if hasattr(runner, "prepare_step"):
        def prepare():
            step = runner.prepare_step(plan)
            return step.attn_metadata(backend), step.sampling
        api = "staged (prepare_step)"
    else:
        from steploop.gpu_worker.step_inputs import prepare_step_inputs

        def prepare():
            inputs = prepare_step_inputs(runner.batch, plan, BLOCK, 2048, runner.device)
            return backend.build_metadata(inputs.attn), runner._sampling_metadata(inputs)
        api = "lists (prepare_step_inputs)"
    for _ in range(20):
        prepare()
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        prepare()
        times.append(time.perf_counter() - t)
    print(f"{api}: decode step of {args.batch} requests, preparation median {statistics.median(times) * 1e6:.0f} us, "
          f"p10 {statistics.quantiles(times, n=10)[0] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
