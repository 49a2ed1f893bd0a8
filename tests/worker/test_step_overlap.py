"""A step kept in flight (step_overlap.py): plan N+1 launched before step N is finished gives the same tokens and
logprobs as finishing every step first, whatever the sampling, chunking, stops and preemptions. On the CPU nothing
overlaps (a step's work is done when launch returns), but the bookkeeping is the GPU's: placeholders in the token
lists, step N+1's inputs filled from step N's sampled tokens on the device, results in plan order."""

from __future__ import annotations

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.step_inputs import StepInputs
from steploop.gpu_worker.step_overlap import LaunchedStep, may_follow, placeholder, reads_outputs
from tests.worker.driver import Driver, InFlightDriver

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 563, 28655, 30, 95, 2016, 216], [1, 11311, 2643]]


@pytest.fixture
def in_flight_runner(fresh_runner, monkeypatch):
    monkeypatch.setattr(fresh_runner, "keep_in_flight", True)
    yield fresh_runner


@pytest.fixture
def hole_fills(monkeypatch):
    """How many input tokens were filled on the device from a step in flight."""
    filled = [0]
    inner = StepInputs.fill_holes

    def counting(self, tokens):
        if self.holes is not None:
            filled[0] += len(self.holes[0])
        return inner(self, tokens)

    monkeypatch.setattr(StepInputs, "fill_holes", counting)
    return filled


def _run(driver, requests, chunk, preempt_at=None):
    for handle, (prompt, max_tokens, sampling) in enumerate(requests):
        driver.add(handle, prompt, max_tokens, sampling)
    for n in range(400):
        if not driver.requests:
            break
        if preempt_at is not None and n == preempt_at[1] and preempt_at[0] in driver.requests:
            driver.preempt(preempt_at[0])
        driver.step(chunk)
    if isinstance(driver, InFlightDriver):
        driver.drain()
    logprobs = {}
    for result in driver.results:
        for handle, lps in result.logprobs.items():
            if handle in result.sampled:
                logprobs.setdefault(handle, []).extend(lp.logprob for lp in lps)
    return driver.outputs, logprobs


def _both(runner, requests, chunk, preempt_at=None):
    runner.keep_in_flight = False
    want = _run(Driver(runner), requests, chunk)
    runner.reset()
    runner.keep_in_flight = True
    got = _run(InFlightDriver(runner), requests, chunk, preempt_at)
    return want, got


def test_greedy_seeded_and_logprobs_equal_finishing_each_step(in_flight_runner, hole_fills):
    requests = [(PROMPTS[0], 9, SamplingParams(logprobs=2)),
                (PROMPTS[1], 6, SamplingParams(temperature=0.8, top_k=20, seed=7, logprobs=0)),
                (PROMPTS[2], 7, SamplingParams(temperature=1.0, top_p=0.9, seed=11, min_tokens=3))]
    (want, want_lp), (got, got_lp) = _both(in_flight_runner, requests, 4)
    assert got == want
    assert got_lp.keys() == want_lp.keys()
    for handle in want_lp:   # a step's rows are the same requests: the same logprobs to fp32 rounding
        assert got_lp[handle] == pytest.approx(want_lp[handle], abs=1e-5)
    assert hole_fills[0] >= 10      # decodes took their input token from the step in flight


def test_a_stop_mid_flight_drops_the_extra_token(in_flight_runner, hole_fills):
    """max_tokens 1 and 2: the step in flight already computes a token the request will not keep."""
    requests = [(PROMPTS[0], 1, SamplingParams()), (PROMPTS[1], 2, SamplingParams()),
                (PROMPTS[2], 5, SamplingParams())]
    (want, _), (got, _) = _both(in_flight_runner, requests, 16)
    assert got == want and [len(got[h]) for h in range(3)] == [1, 2, 5]


def test_preemption_while_its_step_is_in_flight(in_flight_runner):
    requests = [(PROMPTS[0], 8, SamplingParams()), (PROMPTS[1], 8, SamplingParams(temperature=0.7, seed=3))]
    (want, _), (got, _) = _both(in_flight_runner, requests, 3, preempt_at=(1, 5))
    assert got == want


def test_penalties_finish_the_step_before_the_next_is_launched(in_flight_runner, hole_fills):
    """A penalized request reads its outputs on the host when its next row is sampled: the step in flight is
    finished first. Tokens as without a step in flight."""
    requests = [(PROMPTS[0], 6, SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)),
                (PROMPTS[1], 6, SamplingParams(bad_words=((563, 28655),)))]
    (want, _), (got, _) = _both(in_flight_runner, requests, 8)
    assert got == want
    assert hole_fills[0] == 0


def test_results_come_in_plan_order_one_step_behind(in_flight_runner):
    driver = InFlightDriver(in_flight_runner)
    driver.add(0, PROMPTS[0], 4)
    driver.add(1, PROMPTS[1], 4)
    first = driver.step(64)                        # prompts: in flight, nothing back yet
    assert first == [] and in_flight_runner.in_flight is not None
    second = driver.step(64)                       # the first decode launched, then the prompts' step finished
    assert [r.step_id for r in second] == [0] and set(second[0].sampled) == {0, 1}
    tail = driver.drain()
    assert [r.step_id for r in tail] == [1] and in_flight_runner.in_flight is None
    driver.step(1)                                 # in flight again: execute() would lose its result
    with pytest.raises(RuntimeError, match="in flight"):
        in_flight_runner.execute(driver.plan(1))


def test_may_follow_rules():
    slot = type("Slot", (), {})

    def launched(drafts, sampling):
        s = slot()
        s.handle, s.drafts = 5, drafts
        state = type("State", (), {"sampling": sampling})()
        return LaunchedStep(StepPlan(step_id=0), None, sampling=[s], states=[state])

    plan = StepPlan(step_id=1, scheduled_handles=[5], num_scheduled_tokens=[1])
    other = StepPlan(step_id=1, scheduled_handles=[6], num_scheduled_tokens=[1])
    assert may_follow(launched([], SamplingParams(temperature=0.5, seed=1, logprobs=3)), plan)
    assert not may_follow(launched([17], SamplingParams()), plan)               # drafts: accepted count unknown
    assert not may_follow(launched([], SamplingParams(frequency_penalty=0.2)), plan)
    assert not may_follow(launched([], SamplingParams(regex="[a-z]+")), plan)
    assert may_follow(launched([], SamplingParams(frequency_penalty=0.2)), other)   # not in the next plan
    assert reads_outputs(SamplingParams(bad_words=((1, 2),))) and not reads_outputs(SamplingParams(min_tokens=4))
    assert placeholder(0) == -1 and placeholder(7) == -8


def test_launching_a_decode_behind_a_step_in_flight_waits_for_nothing(in_flight_runner):
    """launch(N+1) with step N in flight: the step's one staged copy, no host-device sync (the only wait is in
    finish(N), for N's own token copy). Counted as test_step_prep_copies counts them, on the GPU's staging route."""
    from steploop.gpu_worker.staging import StagingBuffer
    from tests.worker.test_step_prep_copies import CopySyncCounter

    driver = InFlightDriver(in_flight_runner)
    for i in range(4):
        driver.add(i, [1, 5 + i, 17, 300], 8, SamplingParams(temperature=0.5, seed=i, logprobs=1))
    driver.step(64)
    driver.step(1)
    in_flight_runner.staging = StagingBuffer(in_flight_runner.device, direct=False)
    launch, counts = in_flight_runner._launch, []

    def counted(plan):
        with CopySyncCounter() as counter:
            launched = launch(plan)
        counts.append(dict(counter.counts))
        return launched

    in_flight_runner._launch = counted
    try:
        driver.step(1)
    finally:
        del in_flight_runner._launch
        in_flight_runner.staging = StagingBuffer(in_flight_runner.device)
    assert counts == [{"copy copy_": 1}]
    driver.drain()
