"""Factories for scheduler tests: create_scheduler, create_requests, a FakeWorker, and a step runner that asserts
the invariants of DESIGN.md after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request, RequestOutput, RequestStatus
from steploop.scheduler.scheduler import Scheduler

EOS = 2
VOCAB = 1000
FIRST_ORDINARY_TOKEN = 10       # the fake model never emits 0..9 unless a test scripts it


def create_scheduler(max_num_batched_tokens: int = 64, max_num_seqs: int = 16, long_prefill_token_threshold: int = 0,
                     num_blocks: int = 1000, block_size: int = 4, max_model_len: int = 1024,
                     eos_token_ids: tuple[int, ...] = (EOS,), async_scheduling: bool = False,
                     admission_watermark: float = 0.0, **config) -> Scheduler:
    """A Scheduler (AsyncScheduler with async_scheduling=True); **config goes to SchedulerConfig."""
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             long_prefill_token_threshold=long_prefill_token_threshold,
                             async_scheduling=async_scheduling, admission_watermark=admission_watermark, **config)
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
    return make_scheduler(config, kv, max_model_len, eos_token_ids)


def create_requests(num: int, prompt_len: int | list[int] = 8, max_tokens: int = 8, min_tokens: int = 0,
                    stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False, seed: int = 0,
                    prefix: str = "req", priority: int = 0) -> list[Request]:
    rng = random.Random(seed)
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len] * num
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
                              ignore_eos=ignore_eos)
    return [Request(request_id=f"{prefix}-{i}", sampling=sampling, priority=priority, arrival_time=float(i),
                    prompt_token_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(lens[i])])
            for i in range(num)]


def fake_model(tokens: list[int]) -> int:
    """The next token depends only on the history, so results must not depend on the schedule."""
    h = len(tokens)
    for t in tokens[-6:]:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return FIRST_ORDINARY_TOKEN + h % (VOCAB - FIRST_ORDINARY_TOKEN)


@dataclass
class _WorkerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeWorker:
    """Keeps its own persistent batch from plan deltas (as a real worker does) and checks them as it goes.

    Like the real worker it appends its own sampled tokens (so it can run one step ahead of the scheduler under
    async scheduling) and verifies drafts against the model: the matching prefix is accepted, then one token of
    its own.
    """

    block_size: int = 4
    model: object = fake_model           # callable(tokens) -> next token
    fail_steps: set[int] = field(default_factory=set)
    held: dict[int, _WorkerRequest] = field(default_factory=dict)
    # Handles of a failed step: under async scheduling the next plan (built before the failure was known)
    # still names them; the scheduler drops its results, so the worker just skips them.
    failed: set[int] = field(default_factory=set)

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished_handles + plan.preempted_handles:
            assert self.held.pop(handle, None) is not None, f"drop of unknown handle {handle}"
            self.failed.discard(handle)
        for new in plan.new_requests:
            assert new.handle not in self.held, f"handle {new.handle} sent as new twice"
            self.held[new.handle] = _WorkerRequest(new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                                                   new.num_computed_tokens)
        for handle, computed, blocks in zip(plan.cached.handles, plan.cached.num_computed_tokens,
                                            plan.cached.new_block_ids):
            held = self.held[handle]
            assert held.num_computed == computed or handle in self.failed, (
                f"handle {handle}: worker {held.num_computed} != plan {computed}")
            held.block_ids += blocks
        if plan.step_id in self.fail_steps:
            self.failed.update(plan.scheduled_handles)
            return StepResult(step_id=plan.step_id, error="CUDA error: an illegal memory access")
        return StepResult(step_id=plan.step_id, sampled=self._run(plan))

    def _run(self, plan: StepPlan) -> dict[int, list[int]]:
        sampled = {}
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            if handle in self.failed:
                continue
            held, drafts = self.held[handle], plan.draft_token_ids.get(handle, [])
            end = held.num_computed + n - len(drafts)
            assert end <= len(held.tokens), f"handle {handle} scheduled past its tokens"
            assert len(held.block_ids) * self.block_size >= held.num_computed + n, f"handle {handle}: blocks short"
            if end < len(held.tokens):
                assert not drafts, f"handle {handle}: drafts in the middle of its prompt"
                held.num_computed = end
                continue
            out = self._verify(held.tokens, drafts)
            held.tokens.extend(out)
            held.num_computed = end + len(out) - 1
            sampled[handle] = out
        return sampled

    def _verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        """Accepted drafts, then the model's own next token."""
        out: list[int] = []
        while True:
            token = self.model(tokens + out)
            out.append(token)
            if len(out) > len(drafts) or drafts[len(out) - 1] != token:
                return out


def gaps(sched: Scheduler) -> dict[int, int]:
    """Gap of each live request before drafts (schedule() proposes drafts itself; check_plan adds those sent)."""
    live = list(sched.running) + list(sched.waiting)
    return {r.handle: r.num_tokens + r.num_output_placeholders - r.num_computed_tokens for r in live}


def check_plan(sched: Scheduler, plan: StepPlan, gaps_before: dict[int, int]) -> None:
    cfg = sched.config
    assert plan.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(set(plan.scheduled_handles)) == len(plan.scheduled_handles), "a handle scheduled twice"
    for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
        gap = gaps_before[handle] + len(plan.draft_token_ids.get(handle, ()))
        assert 0 < n <= gap, f"handle {handle}: scheduled {n}, gap {gap}"
    if plan.preempted_handles:
        assert not plan.new_requests, "admitted new requests in a step that preempted"
    for handle in plan.scheduled_handles:
        r = sched.handles.by_handle[handle]
        assert r.num_output_tokens + r.num_output_placeholders <= r.sampling.max_tokens, f"{handle}: past max_tokens"
        assert r.num_computed_tokens <= sched.max_model_len - 1, f"{handle}: past max_model_len"
        assert len(plan.draft_token_ids.get(handle, ())) <= sched.config.num_speculative_tokens
    sched.check_integrity()


@dataclass
class Run:
    """Outputs collected per request id over a run."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, RequestStatus] = field(default_factory=dict)
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    steps: int = 0
    plans: list[StepPlan] = field(default_factory=list)

    def collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.finish, f"{out.request_id}: output after it finished"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.outputs.setdefault(out.request_id, []).append(out)
            if out.finish_reason is not None:
                self.finish[out.request_id] = out.finish_reason


def step(sched: Scheduler, worker: FakeWorker, run: Run) -> StepPlan:
    before = gaps(sched)
    plan = sched.schedule()
    check_plan(sched, plan, before)
    run.collect(sched.update_from_output(plan, worker.execute(plan)))
    sched.check_integrity()
    run.steps += 1
    run.plans.append(plan)
    return plan


def run_until_idle(sched: Scheduler, worker: FakeWorker, run: Run | None = None, max_steps: int = 20_000) -> Run:
    if sched.config.async_scheduling:
        return run_async_until_idle(sched, worker, run, max_steps)
    run = run or Run()
    while sched.has_unfinished_requests():
        step(sched, worker, run)
        assert run.steps < max_steps, "no progress"
    assert_idle(sched)
    return run


@dataclass
class AsyncDriver:
    """Keeps ONE plan in flight, as an async engine loop does: schedule N+1, then apply the result of N."""

    sched: Scheduler
    worker: FakeWorker
    run: Run = field(default_factory=Run)
    pending: tuple[StepPlan, StepResult] | None = None

    def step(self) -> StepPlan:
        before = gaps(self.sched)
        plan = self.sched.schedule()
        check_plan(self.sched, plan, before)
        result = self.worker.execute(plan)         # the worker runs plans in order, N+1 right after N
        self.flush()
        self.pending = (plan, result) if plan.scheduled_handles or plan.kv_moves else None
        self.run.steps += 1
        self.run.plans.append(plan)
        return plan

    def flush(self) -> None:
        if self.pending is not None:
            self.run.collect(self.sched.update_from_output(*self.pending))
            self.pending = None
            self.sched.check_integrity()

    def busy(self) -> bool:
        return self.sched.has_unfinished_requests() or self.pending is not None


def run_async_until_idle(sched: Scheduler, worker: FakeWorker, run: Run | None = None,
                         max_steps: int = 20_000) -> Run:
    driver = AsyncDriver(sched, worker, run or Run())
    while driver.busy():
        driver.step()
        assert driver.run.steps < max_steps, "no progress"
    assert_idle(sched)
    return driver.run


def assert_idle(sched: Scheduler) -> None:
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks, "blocks leaked"
    sched.check_integrity()


def expected_output(request: Request, max_model_len: int = 1024, eos: tuple[int, ...] = (EOS,),
                    model=fake_model) -> tuple[list[int], RequestStatus]:
    """What the request must produce, computed without any scheduler."""
    tokens, out, p = list(request.prompt_token_ids), [], request.sampling
    while True:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= p.min_tokens and ((t in eos and not p.ignore_eos) or t in p.stop_token_ids):
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= p.max_tokens or len(tokens) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH
