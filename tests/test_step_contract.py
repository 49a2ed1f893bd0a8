"""The worker seam's StepResult survives the wire, per-request failures included: a request the worker cannot serve
as asked travels as (handle, code, message, param) beside the tokens of the requests that did sample; a StepPlan's
stage tokens (-pp) travel as packed (handle, token) pairs, in order; encoder slices as (hash, layers) pairs, and
the hello's vision-tower depth with them."""

from __future__ import annotations

from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.step_contract import RequestFailure, StepPlan, StepResult, TokenLogprob


def round_trip(result: StepResult) -> StepResult:
    return StepResult.from_pb(worker_pb2.StepResult.FromString(result.to_pb().SerializeToString()))


def test_step_result_round_trip_with_failures():
    result = StepResult(
        step_id=7, sampled={3: [11], 5: [12, 13]}, logprobs={3: [TokenLogprob(-0.5)], 5: [TokenLogprob(-1.0)] * 2},
        forward_seconds=0.25, prompt_logprobs={9: [TokenLogprob(-2.0, [4], [-0.25])]},
        failed={4: RequestFailure("invalid_grammar", "the JSON schema does not compile: x", "json_schema"),
                8: RequestFailure("invalid_grammar", "the regex cannot be enforced: lookahead", "regex")})
    assert round_trip(result) == result


def test_failures_default_empty_and_a_failure_without_param():
    assert round_trip(StepResult(step_id=1, sampled={2: [3]})).failed == {}
    only = StepResult(step_id=2, failed={6: RequestFailure("invalid_grammar", "no")})
    back = round_trip(only)
    assert back == only and back.sampled == {} and back.failed[6].param == ""
    assert not back.error      # a per-request failure is not a failed step


def test_failures_on_the_wire():
    pb = StepResult(step_id=3, failed={4: RequestFailure("c", "m", "p")}).to_pb()
    assert [(f.handle, f.code, f.message, f.param) for f in pb.request_failures] == [(4, "c", "m", "p")]
    assert not pb.error


def test_plan_stage_tokens_round_trip_in_order():
    plan = StepPlan(step_id=4, scheduled_handles=[1, 2], num_scheduled_tokens=[1, 1],
                    stage_token_handles=[2, 1, 2], stage_token_ids=[40, 41, 42])
    back = StepPlan.from_pb(worker_pb2.StepPlan.FromString(plan.to_pb().SerializeToString()))
    assert back == plan
    assert StepPlan.from_pb(StepPlan(step_id=5).to_pb()).stage_token_ids == []


def test_plan_encoder_slices_and_the_hellos_encoder_layers_round_trip():
    from steploop.common.step_contract import WorkerInfo
    plan = StepPlan(step_id=6, encoder_slices=[("aa", 2), ("bb", 1)])
    assert StepPlan.from_pb(worker_pb2.StepPlan.FromString(plan.to_pb().SerializeToString())) == plan
    info = WorkerInfo(worker_id="w", model_name="m", block_size=16, num_kv_blocks=8, max_model_len=64,
                      vocab_size=10, eos_token_ids=(1,), encoder_layers=32)
    assert WorkerInfo.from_pb(info.to_pb()).encoder_layers == 32
