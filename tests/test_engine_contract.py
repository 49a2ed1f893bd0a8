"""The Engine seam's dataclasses survive the wire: EngineRequest and EngineChunk round-trip through their
protobuf messages, and FinishReason keeps the wire's values."""

from __future__ import annotations

from services.common.engine_contract import EngineChunk, EngineRequest, FinishReason, Usage
from services.common.pb.steploop.v1 import engine_pb2
from services.common.sampling_params import SamplingParams
from services.common.step_contract import TokenLogprob


def test_finish_reasons_are_the_wire_values():
    assert [(r.name, int(r)) for r in FinishReason] == [
        ("NONE", engine_pb2.FINISH_REASON_UNSPECIFIED), ("STOP", engine_pb2.FINISH_REASON_STOP),
        ("LENGTH", engine_pb2.FINISH_REASON_LENGTH), ("ABORT", engine_pb2.FINISH_REASON_ABORT),
        ("ERROR", engine_pb2.FINISH_REASON_ERROR), ("REJECTED", engine_pb2.FINISH_REASON_REJECTED)]


def test_request_round_trip():
    request = EngineRequest("r1", [5, 6, 7], SamplingParams(temperature=0.5, seed=3, logprobs=2), priority=-1,
                            cache_salt="tenant", resume_output_token_ids=[9, 10])
    assert EngineRequest.from_pb(request.to_pb()) == request
    assert request.to_pb().resume_output_token_ids == [9, 10]
    assert EngineRequest.from_pb(engine_pb2.GenerateRequest(prompt_token_ids=[1])).sampling.max_tokens is None


def test_chunk_round_trip_with_and_without_logprobs():
    lp = TokenLogprob(-0.5, [3, 4], [-0.25, -2.0])   # float32 on the wire: exactly representable values
    middle = EngineChunk([7, 8], [lp, lp], prompt_logprobs=[TokenLogprob(-1.0)])
    assert EngineChunk.from_pb(middle.to_pb()) == middle and not middle.finished
    last = EngineChunk([2], [lp], FinishReason.STOP, stop_token_id=2, usage=Usage(3, 5, 1))
    assert EngineChunk.from_pb(last.to_pb()) == EngineChunk([2], [lp], FinishReason.STOP, 2, Usage(3, 5, 1), "", [])
    plain = EngineChunk.from_pb(EngineChunk([9]).to_pb(), with_logprobs=False)
    assert plain == EngineChunk([9]) and plain.usage is None
    failed = EngineChunk.from_pb(EngineChunk([], finish_reason=FinishReason.ERROR, error_message="boom",
                                             usage=Usage(3, 0, 0)).to_pb(), with_logprobs=False)
    assert (failed.finish_reason, failed.error_message, failed.usage) == (FinishReason.ERROR, "boom", Usage(3, 0, 0))
    into = engine_pb2.SessionChunk(request_id="r")
    last.to_pb(into.chunk)
    assert (list(into.chunk.token_ids), into.chunk.finish_reason, into.chunk.usage.completion_tokens) == (
        [2], engine_pb2.FINISH_REASON_STOP, 5)


def test_rejected_chunk_carries_its_error_across_the_wire():
    """A request the worker could not serve as asked ends with REJECTED and the error's code and field."""
    chunk = EngineChunk([], finish_reason=FinishReason.REJECTED, usage=Usage(4, 0, 0),
                        error_message="the regex does not compile: unclosed (", error_code="invalid_grammar",
                        error_param="regex")
    pb = chunk.to_pb()
    assert (pb.finish_reason, pb.error_code, pb.error_param) == (engine_pb2.FINISH_REASON_REJECTED,
                                                                 "invalid_grammar", "regex")
    for with_logprobs in (True, False):
        back = EngineChunk.from_pb(engine_pb2.GenerateChunk.FromString(pb.SerializeToString()), with_logprobs)
        assert (back.finish_reason, back.error_message, back.error_code, back.error_param, back.usage) == (
            FinishReason.REJECTED, chunk.error_message, "invalid_grammar", "regex", Usage(4, 0, 0))
    assert EngineChunk.from_pb(EngineChunk([5]).to_pb()).error_code == ""      # only a finished chunk has one
