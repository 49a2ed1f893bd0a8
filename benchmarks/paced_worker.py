"""A worker without a model, for measuring what the services around it cost:  python -m benchmarks.paced_worker

It is the real worker process (services/gpu_worker/server.py: the plan stream, its reader, forward thread and
result writer) with the ModelRunner replaced by one that sleeps `--step-ms` per step and samples a token that
depends only on the request's own history (its prompt's tokens, cycling), so the text the gateway
detokenizes is real text of the prompt's vocabulary. Sleeping costs no CPU, so the CPU the gateway, the
scheduler and this process use under load is what serving those tokens costs, free of the model's noise.
Takes the worker's own flags (it is started the way the real worker is) plus --step-ms and --max-model-len.
"""

from __future__ import annotations

import sys
import time

from steploop.common import event_loop, observability
from steploop.common.model_path import DEFAULT_MODEL
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.server import build_parser, serve

EOS = 2   # SmolLM2's <|im_end|>: never sampled here (the prompt cycle skips it), so max_tokens ends each request


class PacedRunner:
    """What the worker server needs of a ModelRunner: info, execute(plan) -> StepResult, reset()."""

    def __init__(self, info: WorkerInfo, step_s: float):
        self.info, self.step_s = info, step_s
        self.held: dict[int, tuple[list[int], int, list[int]]] = {}   # handle -> (token ids, computed, cycle)

    def reset(self) -> None:
        self.held.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for handle in plan.finished_handles + plan.preempted_handles:
            self.held.pop(handle, None)
        for new in plan.new_requests:
            cycle = [t for t in new.prompt_token_ids if t != EOS] or [0]
            self.held[new.handle] = (new.prompt_token_ids + new.output_token_ids, new.num_computed_tokens, cycle)
        sampled = {}
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            tokens, computed, cycle = self.held[handle]
            computed += n
            if computed >= len(tokens):       # the end of what it knows: sample one (drafts are never accepted)
                token = cycle[len(tokens) % len(cycle)]
                tokens.append(token)
                computed = len(tokens) - 1
                sampled[handle] = [token]
            self.held[handle] = (tokens, computed, cycle)
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))
        return StepResult(step_id=plan.step_id, sampled=sampled, forward_seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--step-ms", type=float, default=100.0, help="the time each step takes (slept)")
    args = parser.parse_args(argv)
    observability.setup("worker", args)
    config = WorkerConfig.from_args(args)
    info = WorkerInfo(worker_id="paced-0", model_name=DEFAULT_MODEL, block_size=config.block_size,
                      num_kv_blocks=config.num_kv_blocks or 4096, max_model_len=config.max_model_len or 8192,
                      vocab_size=49152, eos_token_ids=(EOS,))
    event_loop.run(serve(config, runner=PacedRunner(info, args.step_ms / 1000.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
