"""The step cost model and the prefill pacer: prompt chunks slow a decoding step by at most max_decode_slowdown."""

from __future__ import annotations

import random

import pytest

from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.step_cost import StepCostModel, attention_pairs
from tests.scheduler.sched_factories import (
    AsyncDriver,
    FakeWorker,
    Run,
    create_requests,
    create_scheduler,
    run_until_idle,
    step,
)

# A CPU-like machine: 90 ms per step, 1.6 ms per token, 5 ns per (query, key) pair.
A, B, C = 0.090, 0.0016, 5e-9


def true_cost(tokens: int, pairs: float) -> float:
    return A + B * tokens + C * pairs


def plan_shape(plan: StepPlan, ends: dict[int, int]) -> tuple[int, float, int, float]:
    """(tokens, pairs) of the whole step and of its decodes (1-token entries)."""
    tokens = pairs = dec_tokens = dec_pairs = 0
    for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
        p = attention_pairs(n, ends[handle])
        tokens, pairs = tokens + n, pairs + p
        if n == 1:
            dec_tokens, dec_pairs = dec_tokens + 1, dec_pairs + p
    return tokens, pairs, dec_tokens, dec_pairs


class TimedWorker(FakeWorker):
    """FakeWorker whose results carry the forward time the cost function gives the plan's shape."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.shapes: list[tuple[int, float, int, float]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        ends = {h: self.held[h].num_computed if h in self.held else 0 for h in plan.scheduled_handles}
        result = super().execute(plan)
        for new in plan.new_requests:
            ends[new.handle] = new.num_computed_tokens
        ends = {h: ends[h] + n for h, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens)}
        shape = plan_shape(plan, ends)
        self.shapes.append(shape)
        result.forward_seconds = true_cost(shape[0], shape[1])
        return result


def test_cost_model_recovers_a_linear_machine():
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(300):
        tokens = rng.choice([8, 16, 64]) + rng.randrange(0, 400)
        pairs = tokens * rng.randrange(16, 2048)
        model.observe(tokens, pairs, true_cost(tokens, pairs) * rng.uniform(0.98, 1.02))
    a, b, c = model.coefficients()
    assert a == pytest.approx(A, rel=0.1) and b == pytest.approx(B, rel=0.05) and c == pytest.approx(C, rel=0.2)


def test_cost_model_needs_observations_and_ignores_untimed_steps():
    model = StepCostModel(min_observations=4)
    for _ in range(10):
        model.observe(8, 800.0, 0.0)          # a worker that does not time its steps
    assert model.predict(8, 800.0) is None
    for tokens in (8, 9, 10, 40):
        model.observe(tokens, tokens * 100.0, true_cost(tokens, tokens * 100.0))
    assert model.predict(20, 2000.0) == pytest.approx(true_cost(20, 2000.0), rel=0.05)


def test_cost_model_never_predicts_less_time_for_more_work():
    model = StepCostModel(min_observations=2)
    model.observe(10, 0.0, 0.5)
    model.observe(100, 0.0, 0.1)               # noise: bigger step, less time
    a, b, c = model.coefficients()
    assert b >= 0.0 and c >= 0.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_chunks_slow_decoding_steps_by_at_most_the_ratio(async_scheduling):
    ratio = 1.5
    sched = create_scheduler(max_num_batched_tokens=2048, max_num_seqs=32, block_size=16, num_blocks=400,
                             max_model_len=4096, async_scheduling=async_scheduling, max_decode_slowdown=ratio)
    worker = TimedWorker(block_size=16)
    streams = create_requests(8, prompt_len=[20 + i for i in range(8)], max_tokens=200, ignore_eos=True)
    for r in streams:
        sched.add_request(r)
    driver = AsyncDriver(sched, worker) if async_scheduling else None
    run = driver.run if driver else Run()
    advance = driver.step if driver else (lambda: step(sched, worker, run))
    for _ in range(40):                       # the streams decode; the cost model learns from their steps
        advance()
    long = create_requests(1, prompt_len=1500, max_tokens=4, ignore_eos=True, prefix="long", seed=3)[0]
    sched.add_request(long)
    first = len(worker.shapes)
    while long.request_id not in run.finish:
        advance()
        assert len(worker.shapes) < first + 400, "the long prompt made no progress"
    chunk_steps = 0
    for tokens, pairs, dec_tokens, dec_pairs in worker.shapes[first:]:
        if dec_tokens and tokens - dec_tokens > 16:          # a decoding step with more than the minimum chunk
            chunk_steps += 1
            # The allowance comes from the previous step's decodes and a fitted model: a few % of slack.
            assert true_cost(tokens, pairs) <= ratio * true_cost(dec_tokens, dec_pairs) * 1.05
    assert chunk_steps >= 10
    assert sched.pacer.num_paced_steps >= 10 and sched.pacer.num_deferred_tokens > 1000    # what /metrics shows
    assert max(t - d for t, _, d, _ in worker.shapes[first:]) < 200     # never near the 2048 budget


def test_a_prompt_alone_keeps_the_whole_budget():
    sched = create_scheduler(max_num_batched_tokens=512, max_num_seqs=8, block_size=16, num_blocks=200,
                             max_decode_slowdown=1.5)
    worker = TimedWorker(block_size=16)
    warm = create_requests(2, prompt_len=40, max_tokens=20, ignore_eos=True, prefix="warm")
    for r in warm:
        sched.add_request(r)
    run_until_idle(sched, worker)
    assert sched.pacer.cost.coefficients() is not None
    sched.add_request(create_requests(1, prompt_len=1000, max_tokens=2, prefix="alone")[0])
    plan = step(sched, worker, Run())
    assert plan.num_scheduled_tokens == [512]
    assert sched.pacer.num_paced_steps == 0


def test_pacing_changes_no_output_and_can_be_turned_off():
    def outputs(slowdown: float) -> dict[str, list[int]]:
        sched = create_scheduler(max_num_batched_tokens=256, max_num_seqs=16, block_size=8, num_blocks=600,
                                 max_decode_slowdown=slowdown)
        reqs = create_requests(10, prompt_len=[30, 300, 12, 500, 7, 64, 200, 33, 90, 410], max_tokens=24, seed=5)
        for r in reqs:
            sched.add_request(r)
        if slowdown == 0:
            assert sched.pacer is None
        return run_until_idle(sched, TimedWorker(block_size=8)).tokens

    assert outputs(1.2) == outputs(0)


class NoisyTimedWorker(TimedWorker):
    """A machine the linear model fits only on average: decode-only steps run 5% under true_cost (the fit's
    intercept leans on the larger steps) and a step with prompt work lands up to 10% either side of it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rng = random.Random(7)
        self.seconds: list[float] = []

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        tokens, _, dec_tokens, _ = self.shapes[-1]
        result.forward_seconds *= 0.95 if tokens == dec_tokens else self.rng.uniform(0.9, 1.1)
        self.seconds.append(result.forward_seconds)
        return result


def test_pacing_bounds_real_step_times_where_the_model_fits_only_on_average():
    ratio = 1.5
    sched = create_scheduler(max_num_batched_tokens=2048, max_num_seqs=32, block_size=16, num_blocks=600,
                             max_model_len=4096, max_decode_slowdown=ratio)
    worker = NoisyTimedWorker(block_size=16)
    for r in create_requests(8, prompt_len=[20 + i for i in range(8)], max_tokens=400, ignore_eos=True):
        sched.add_request(r)
    run = Run()
    for _ in range(40):
        step(sched, worker, run)
    longs = create_requests(4, prompt_len=1200, max_tokens=2, ignore_eos=True, prefix="long", seed=3)
    first = len(worker.shapes)
    for r in longs:
        sched.add_request(r)
    while any(r.request_id not in run.finish for r in longs):
        step(sched, worker, run)
        assert len(worker.shapes) < first + 600, "the long prompts made no progress"
    # Real time of each step with a prompt chunk beside the decodes, over the decodes' real time alone.
    real = worker_ratios(worker, first)
    assert len(real) >= 20
    real.sort()
    assert real[int(0.95 * len(real))] <= ratio          # the bound holds at the tail, not only on average
    assert real[len(real) // 2] >= 1.25                  # and the allowance is still used, not thrown away
    assert sched.pacer.mixed_spread.upper() > 1.05       # the spread it paced by


def worker_ratios(worker: NoisyTimedWorker, first: int) -> list[float]:
    out = []
    for (tokens, pairs, dec_tokens, dec_pairs), seconds in zip(worker.shapes[first:], worker.seconds[first:]):
        if dec_tokens and tokens - dec_tokens > 16:
            out.append(seconds / (0.95 * true_cost(dec_tokens, dec_pairs)))
    return out


def test_prediction_spread_tracks_mean_and_tail():
    from steploop.scheduler.prediction_spread import PredictionSpread
    spread, rng = PredictionSpread(min_observations=4), random.Random(0)
    assert spread.mean() == spread.upper() == 1.0
    spread.observe(1.0, None)                            # an unfitted model's step teaches nothing
    spread.observe(0.0, 1.0)
    assert spread.num_observations == 0
    for _ in range(400):
        spread.observe(rng.gauss(1.2, 0.05), 1.0)
    assert spread.mean() == pytest.approx(1.2, abs=0.03)
    assert spread.upper() == pytest.approx(1.3, abs=0.05)


def test_a_noisy_machine_costs_prompts_at_most_half_the_allowance():
    """Neighbours' noise makes the spread wide; prompts still get half the uncorrected allowance."""
    from steploop.scheduler.prefill_pacing import PrefillPacer
    from tests.scheduler.test_encoder_pacing import FixedCost
    pacer = PrefillPacer(1.5, 16, FixedCost(0.1, 0.001, 0.0, 0.0))
    for i in range(40):
        pacer.mixed_spread.observe((0.5, 2.0)[i % 2], 1.0)
    assert pacer.mixed_spread.upper() > 2.0
    pacer.begin_step(4)
    pacer.tally_decodes(4, 400)
    pacer.end_step(0)
    pacer.begin_step(4)
    assert pacer.clip(1000, 0) == 26          # (1.25 - 1) * (0.1 + 4 * 0.001) s at 1 ms a token
