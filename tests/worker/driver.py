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
        plan = self.plan(chunk)
        result = self.runner.execute(plan)
        assert not result.error, result.error
        self._update(plan, result)
        self.results.append(result)
        return result

    def plan(self, chunk: int | dict[int, int]) -> StepPlan:
        plan = StepPlan(step_id=self.step_id, finished_handles=self.finished, preempted_handles=self.preempted)
        self.finished, self.preempted, self.step_id = [], [], self.step_id + 1
        for req in self.requests.values():
            n = min(self._gap(req), chunk if isinstance(chunk, int) else chunk[req.handle])
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
            self._scheduled(req, n)
        return plan

    def _gap(self, req: DriverRequest) -> int:
        return len(req.tokens) - req.num_computed

    def _scheduled(self, req: DriverRequest, n: int) -> None:
        pass

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
                self._append_output(req, result.sampled[handle])

    def _append_output(self, req: DriverRequest, tokens: list[int]) -> bool:
        """Append a request's sampled tokens; at max_tokens or EOS it finishes (True): blocks freed, handle sent
        as finished with the next plan."""
        req.output.extend(tokens)
        if len(req.output) < req.max_tokens and self.eos_token_id not in req.output:
            return False
        self.outputs[req.handle] = req.output[:req.max_tokens]
        self.free.extend(req.blocks)
        del self.requests[req.handle]
        self.finished.append(req.handle)
        return True


class InFlightDriver(Driver):
    """Plays the async scheduler against a runner that keeps a step in flight (step_overlap.py): plan N+1 is built
    before step N's tokens are back (a request that samples in step N counts one placeholder, and is scheduled one
    token ahead), and is submitted while step N may still be in flight. A request that finished at step N has its
    step N+1 token dropped, as the scheduler drops it."""

    def __init__(self, runner, num_blocks: int | None = None, eos_token_id: int | None = None):
        super().__init__(runner, num_blocks, eos_token_id)
        self.placeholders: dict[int, int] = {}     # handle -> tokens sampled in steps not back yet
        self.outstanding: list[tuple[StepPlan, set[int]]] = []   # plans submitted (and whose tokens they may
                                                                  # still bring), results not back, in order

    def step(self, chunk: int | dict[int, int]) -> list[StepResult]:
        plan = self.plan(chunk)
        self.outstanding.append((plan, set(plan.scheduled_handles)))
        return self._take(self.runner.submit(plan))

    def preempt(self, handle: int) -> None:
        """As the scheduler: the tokens of steps in flight for it are dropped when they come."""
        super().preempt(handle)
        self.placeholders.pop(handle, None)
        for _, live in self.outstanding:
            live.discard(handle)

    def drain(self) -> list[StepResult]:
        return self._take(self.runner.drain())

    def run(self, chunk: int | dict[int, int] = 8, max_steps: int = 500) -> dict[int, list[int]]:
        for _ in range(max_steps):
            if not self.requests:
                break
            self.step(chunk)
        self.drain()
        return self.outputs

    def _take(self, results: list[StepResult]) -> list[StepResult]:
        for result in results:
            assert not result.error, result.error
            plan, live = self.outstanding.pop(0)
            self._update(plan, result, live)
            self.results.append(result)
        return results

    def _gap(self, req: DriverRequest) -> int:
        pending = self.placeholders.get(req.handle, 0)
        if pending and len(req.output) + pending >= req.max_tokens:
            return 0                                 # its last token is being sampled
        return len(req.tokens) + pending - req.num_computed

    def _scheduled(self, req: DriverRequest, n: int) -> None:
        req.num_computed += n
        if req.num_computed == len(req.tokens) + self.placeholders.get(req.handle, 0):   # it samples
            self.placeholders[req.handle] = self.placeholders.get(req.handle, 0) + 1

    def _update(self, plan: StepPlan, result: StepResult, live: set[int] = frozenset()) -> None:
        for handle in plan.scheduled_handles:
            req = self.requests.get(handle)
            if req is None or handle not in result.sampled or handle not in live:
                continue                             # finished meanwhile: its token is dropped
            self.placeholders[handle] -= 1
            if self._append_output(req, result.sampled[handle]):
                self.placeholders.pop(handle)
