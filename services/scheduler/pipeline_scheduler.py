"""PipelineScheduler: one plan in flight per pipeline stage (-pp N), so the stages work at once.

vLLM's batch queue: the engine loop keeps up to N plans outstanding, and each plan's batch is disjoint from the
batches still in flight, so no request ever has two steps in flight:

    stage 0:  plan 0 (A, B)  plan 1 (C, D)  plan 2 (A, B)  plan 3 (C, D) ...
    stage 1:                 plan 0 (A, B)  plan 1 (C, D)  plan 2 (A, B) ...
                             └─ result 0 is back before plan 2 is built, so plan 2 knows A's and B's tokens

Each plan takes at most ceil(R / N) requests, R the live ones (running, and waiting up to max_num_seqs), so the
batches balance: without the cap the first plan would take every request and the next one none, and the stages
would alternate after all.

A request is *busy* from the plan that schedules it until that plan's result is applied: it gets no tokens
(`_num_new_tokens` 0), even as the head of the waiting queue after a preemption (its stale step must come back
first, or its result could land on its recomputation). The scheduling itself is the synchronous Scheduler's:
no output placeholders, so a decode's gap is 0 until its token arrives.

Only the last stage samples. The stages before it learn each token from the plan of the request's next step
(StepPlan.stage_token_*): the tokens appended here since the stages last saw the request.
"""

from __future__ import annotations

from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus
from steploop.scheduler.scheduler import Scheduler


class PipelineScheduler(Scheduler):
    def __init__(self, *args, num_stages: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._num_stages = num_stages               # -pp: plans in flight at most
        # Scheduled by a plan whose result is pending -> whether that step is a prompt chunk that leaves tokens to
        # compute (its gap stays > 0 while it is busy); _num_busy_chunks counts the True ones.
        self._busy: dict[Request, bool] = {}
        self._num_busy_chunks = 0
        self._stage_known: dict[Request, int] = {}  # tokens the stages before the last hold, per request
        self._cap = self._num_planned = 0           # requests this plan may take, and has taken so far

    def add_request(self, request: Request) -> None:
        # A beam's next token is the group's ranking, not what the last stage sampled; the stage-token hand-off
        # above has not been built for that, so beams are refused rather than served wrong.
        if request.beam is not None:
            raise RequestRejectedError(f"beam search is not supported with --pipeline-parallel-size "
                                       f"{self._num_stages} yet; serve it without -pp", "invalid_value",
                                       "use_beam_search")
        super().add_request(request)

    def schedule(self) -> StepPlan:
        live = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        self._cap, self._num_planned = -(-live // self._num_stages), 0
        plan = super().schedule()
        in_flight = self._in_flight.get(plan.step_id)
        if in_flight is None:
            return plan
        requests, ends = in_flight
        new = {n.handle for n in plan.new_requests}
        for request, end in zip(requests, ends):
            chunk = self._busy[request] = end < request.num_tokens
            self._num_busy_chunks += chunk
            known = request.num_tokens if request.handle in new else self._stage_known[request]
            for position in range(known, request.num_tokens):
                plan.stage_token_handles.append(request.handle)
                plan.stage_token_ids.append(request.output_token_ids[position - request.num_prompt])
            self._stage_known[request] = request.num_tokens
        return plan

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        in_flight = self._in_flight.get(plan.step_id)
        outputs = super().update_from_output(plan, result)
        if in_flight is not None:
            for request in in_flight[0]:
                self._num_busy_chunks -= self._busy.pop(request, False)
        return outputs

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request in self._busy or self._num_planned >= self._cap:
            return 0
        return super()._num_new_tokens(request, budget)

    def _advance(self, plan: StepPlan, request: Request, num_new: int) -> int:
        self._num_planned += 1
        return super()._advance(plan, request, num_new)

    def _schedule_decodes(self, plan: StepPlan, i: int, budget: int, scheduled: list[Request],
                          ends: list[int]) -> tuple[int, int]:
        # The C loop takes any request whose gap is 1 for a plain decode; a busy prompt chunk may have a gap of 1
        # left, so while one is in flight every request takes the Python path (rare: long prompts only). A busy
        # decode has a gap of 0, which C hands back to Python. A decode is one token, so the cap is a budget.
        room = min(budget, self._cap - self._num_planned)
        if self._num_busy_chunks or room <= 0:
            return i, budget
        before = len(scheduled)
        i, left = super()._schedule_decodes(plan, i, room, scheduled, ends)
        self._num_planned += len(scheduled) - before
        return i, budget - (room - left)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._stage_known.pop(request, None)
        super()._finish(request, status)

    def preempt_all(self) -> None:
        super().preempt_all()          # results of plans in flight are ignored from now on
        self._busy.clear()
        self._num_busy_chunks = 0
        self._stage_known.clear()

