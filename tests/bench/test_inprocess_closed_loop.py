"""InProcessEngine.run(max_concurrency=N): a closed loop like the bench client's --max-concurrency (no model: the
scheduler tests' FakeWorker stands in for the ModelRunner)."""

from types import SimpleNamespace

import pytest

from benchmarks.inprocess import InProcessEngine
from steploop.scheduler.config import SchedulerConfig
from tests.scheduler.sched_factories import EOS, FakeWorker


class FakeRunner:
    """ModelRunner's surface as InProcessEngine uses it; records the most requests the worker held at once."""

    def __init__(self):
        self.info = SimpleNamespace(num_kv_blocks=512, block_size=4, max_model_len=256, eos_token_ids=(EOS,))
        self.worker, self.peak, self.new = FakeWorker(block_size=4), 0, []

    def reset(self):
        self.worker, self.peak, self.new = FakeWorker(block_size=4), 0, []

    def execute(self, plan):
        result = self.worker.execute(plan)
        self.new += [r.handle for r in plan.new_requests]
        self.peak = max(self.peak, len(self.worker.held))
        return result


def _engine(async_scheduling: bool) -> InProcessEngine:
    engine = InProcessEngine.__new__(InProcessEngine)         # no model: only the scheduling loop is under test
    engine.sched_config = SchedulerConfig(async_scheduling=async_scheduling)
    engine.runner = FakeRunner()
    return engine


PROMPTS = [([10 + i, 11 + i, 12 + i] * (1 + i % 3), 3 + (i * 7) % 9) for i in range(11)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_at_most_n_in_flight_and_every_request_completes(async_scheduling):
    engine = _engine(async_scheduling)
    summary, results = engine.run(PROMPTS, max_concurrency=3)
    assert engine.runner.peak == 3                              # the batch is kept full, never above the cap
    assert len(engine.runner.new) == len(PROMPTS)
    assert summary["completed"] == len(PROMPTS)
    assert [r.output_tokens for r in results] == [n for _, n in PROMPTS]       # exact lengths, in prompt order
    starts = [r.start_time for r in results]
    assert starts[:3] == sorted(starts[:3]) and min(starts[3:]) > max(starts[:3])   # later ones added later
    assert all(0 < r.ttft <= r.latency for r in results)       # counted from when each was added


def test_without_a_cap_everything_arrives_at_once():
    engine = _engine(True)
    summary, results = engine.run(PROMPTS)
    assert engine.runner.peak == len(PROMPTS)
    assert summary["completed"] == len(PROMPTS)
    assert [r.output_tokens for r in results] == [n for _, n in PROMPTS]
