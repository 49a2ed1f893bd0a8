"""A tiny stand-in for the scheduler: allocates blocks, builds StepPlans, feeds results back.

Not the real scheduler: just enough to drive a ModelRunner through chunked prefill and decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, StepPlan, StepResult


@dataclass
class DriverRequest:
    handle: int
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    stage_known: int = 0                  # tokens a pipeline's stages before the last hold (StepPlan.stage_token_*)
    mm_features: list = field(default_factory=list)   # its images (vision-language models)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Driver:
    def __init__(self, runner, num_blocks: int | None = None, eos_token_id: int | None = None):
        """eos_token_id: a request that samples it finishes there (None: requests run to max_tokens)."""
        self.runner = runner
        self.eos_token_id = eos_token_id
        self.block_size = runner.block_size
        self.free = list(range(1, num_blocks or runner.info.num_kv_blocks))   # block 0 is the null block
        self.requests: dict[int, DriverRequest] = {}
        self.step_id = 0
        self.finished: list[int] = []         # to send as finished_handles in the next plan
        self.preempted: list[int] = []        # to send as preempted_handles in the next plan
        self.results: list[StepResult] = []
        self.outputs: dict[int, list[int]] = {}   # handle -> output of a finished request

    def add(self, handle: int, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None,
            output: list[int] = (), mm_features: list = ()) -> None:
        """output: tokens already generated elsewhere (a migrated request); max_tokens counts them."""
        self.requests[handle] = DriverRequest(handle, list(prompt), sampling or SamplingParams(), max_tokens,
                                              list(output), mm_features=list(mm_features))

    def step(self, chunk: int | dict[int, int]) -> StepResult:
        """Schedule min(gap, chunk) tokens for every live request and run one step."""
        plan = StepPlan(step_id=self.step_id, finished_handles=self.finished, preempted_handles=self.preempted)
        self.finished, self.preempted, self.step_id = [], [], self.step_id + 1
        for req in self.requests.values():
            n = min(len(req.tokens) - req.num_computed, chunk if isinstance(chunk, int) else chunk[req.handle])
            if n <= 0:
                continue
            new_blocks = self._grow(req, req.num_computed + n)
            if req.sent:
                plan.cached.append(req.handle, req.num_computed, new_blocks)
                for token in req.tokens[req.stage_known:]:     # sampled since: -pp stages append them
                    plan.stage_token_handles.append(req.handle)
                    plan.stage_token_ids.append(token)
            else:
                plan.new_requests.append(NewRequestData(req.handle, req.prompt, req.output, req.sampling,
                                                        list(req.blocks), req.num_computed,
                                                        mm_features=req.mm_features))
                req.sent = True
            req.stage_known = len(req.tokens)
            plan.scheduled_handles.append(req.handle)
            plan.num_scheduled_tokens.append(n)
        result = self.runner.execute(plan)
        assert not result.error, result.error
        self._update(plan, result)
        self.results.append(result)
        return result

    def preempt(self, handle: int) -> None:
        """Free the request's blocks and start it over (outputs kept), as the scheduler would."""
        req = self.requests[handle]
        self.free.extend(req.blocks)
        req.blocks, req.num_computed, req.sent = [], 0, False
        self.preempted.append(handle)      # the worker drops it; it comes back as new

    def run(self, chunk: int | dict[int, int] = 8, max_steps: int = 500) -> dict[int, list[int]]:
        for _ in range(max_steps):
            if not self.requests:
                break
            self.step(chunk)
        return self.outputs

    def _grow(self, req: DriverRequest, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        new = [self.free.pop(0) for _ in range(max(need, 0))]
        req.blocks.extend(new)
        return new

    def _update(self, plan: StepPlan, result: StepResult) -> None:
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            req = self.requests[handle]
            req.num_computed += n
            if handle in result.sampled:
                req.output.extend(result.sampled[handle])
                if len(req.output) >= req.max_tokens or self.eos_token_id in req.output:
                    self.outputs[handle] = req.output[:req.max_tokens]
                    self.free.extend(req.blocks)
                    del self.requests[handle]
                    self.finished.append(handle)
