"""A request the worker cannot serve as asked (StepResult.failed) ends alone: FINISHED_REJECTED with the worker's
error, its blocks freed at once, while the other requests of the same steps finish exactly as they would have.
Sync and async scheduling; the factories check the invariants (blocks included) after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from steploop.common.step_contract import RequestFailure, StepPlan, StepResult
from steploop.scheduler.request import RequestStatus
from tests.scheduler.sched_factories import (
    FakeWorker,
    Run,
    create_requests,
    create_scheduler,
    expected_output,
    run_until_idle,
    step,
)

FAILURE = RequestFailure("invalid_grammar", "the JSON schema does not compile: bad pattern", "json_schema")


@dataclass
class RejectingWorker(FakeWorker):
    """Fails the handles in `reject` at the step whose plan brings them as new requests (as the real worker's
    check_new does), or at their `after`-th sampled token (a failure found while decoding)."""

    reject: set[int] = field(default_factory=set)
    after: int = 0                        # 0: when new; k: at the step that would sample its k-th token
    samples: dict[int, int] = field(default_factory=dict)

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        for handle in plan.scheduled_handles:
            if handle not in self.reject or handle in self.failed:
                continue
            is_new = any(new.handle == handle for new in plan.new_requests)
            if handle in result.sampled:
                self.samples[handle] = self.samples.get(handle, 0) + 1
            if (self.after == 0 and is_new) or (self.after and self.samples.get(handle) == self.after):
                result.sampled.pop(handle, None)
                result.failed[handle] = FAILURE
                self.failed.add(handle)   # later plans in flight may still name it: skip it, as the real worker
        return result


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("after", [0, 3])
def test_a_failed_request_ends_alone_and_frees_its_blocks(async_scheduling, after):
    sched = create_scheduler(async_scheduling=async_scheduling, max_num_batched_tokens=32)
    requests = create_requests(4, prompt_len=[6, 9, 13, 5], max_tokens=12, ignore_eos=True)
    for r in requests:
        sched.add_request(r)
    bad = requests[1]
    worker = RejectingWorker(reject={bad.handle}, after=after)
    run = run_until_idle(sched, worker)        # integrity after every step; idle: every block free again
    assert run.finish[bad.request_id] == RequestStatus.FINISHED_REJECTED
    last = run.outputs[bad.request_id][-1]
    assert (last.error, last.error_code, last.error_param) == (FAILURE.message, FAILURE.code, FAILURE.param)
    assert last.new_token_ids == []
    assert len(run.tokens.get(bad.request_id, [])) == max(after - 1, 0)   # what it sampled before failing
    for r in requests:
        if r is not bad:
            tokens, status = expected_output(r)
            assert (run.tokens[r.request_id], run.finish[r.request_id]) == (tokens, status), r.request_id


def test_failure_frees_blocks_at_once_and_the_worker_hears_it():
    sched = create_scheduler(max_num_batched_tokens=64)
    good, bad = create_requests(2, prompt_len=[8, 8], max_tokens=5, ignore_eos=True)
    sched.add_request(good)
    sched.add_request(bad)
    worker, run = RejectingWorker(reject={bad.handle}), Run()
    free_before = sched.kv.num_free_blocks
    step(sched, worker, run)
    assert run.finish == {bad.request_id: RequestStatus.FINISHED_REJECTED}
    assert bad.request_id not in sched.requests and not sched.kv.get_block_ids(bad)
    assert sched.kv.num_free_blocks == free_before - len(sched.kv.get_block_ids(good))   # only good holds blocks
    plan = step(sched, worker, run)
    assert bad.handle in plan.finished_handles and bad.handle not in plan.scheduled_handles
    run_until_idle(sched, worker, run)
    assert run.finish[good.request_id] == RequestStatus.FINISHED_LENGTH


def test_failures_of_requests_already_finished_are_dropped():
    """A failure report for a request aborted since its plan was built changes nothing."""
    sched = create_scheduler()
    (req,) = create_requests(1, max_tokens=4, ignore_eos=True)
    sched.add_request(req)
    plan = sched.schedule()
    sched.abort_requests([req.request_id])
    outputs = sched.update_from_output(plan, StepResult(plan.step_id, failed={req.handle: FAILURE}))
    assert outputs == []
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_the_last_chunk_carries_the_error_on_both_engine_paths():
    """Generate streams merge(); Session sends the same chunk inside a SessionChunk."""
    from steploop.common.engine_contract import FinishReason
    from steploop.common.pb.steploop.v1 import engine_pb2
    from steploop.scheduler.request_failures import RejectedOutput
    from steploop.scheduler.request_stream import merge
    from steploop.scheduler.session import outputs_messages

    out = RejectedOutput("r1", [], None, RequestStatus.FINISHED_REJECTED, None, 6, 0, 0, FAILURE.message,
                         error_code=FAILURE.code, error_param=FAILURE.param)
    chunk = merge([out])
    assert (chunk.finish_reason, chunk.error_message, chunk.error_code, chunk.error_param) == (
        FinishReason.REJECTED, FAILURE.message, FAILURE.code, FAILURE.param)
    [message] = outputs_messages({"r1": [out]})
    sent = message.chunks[0]
    assert not sent.HasField("error")          # not an admission error: a finished chunk
    assert (sent.chunk.finish_reason, sent.chunk.error_code, sent.chunk.error_param) == (
        engine_pb2.FINISH_REASON_REJECTED, FAILURE.code, FAILURE.param)
