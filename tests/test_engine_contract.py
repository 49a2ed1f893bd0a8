"""The Engine seam's dataclasses survive the wire: every type with a `from_pb` has a `to_pb` and round-trips
through its protobuf message (EngineRequest, Usage, EngineChunk, ModelInfo, LoadReport), and FinishReason keeps
the wire's values."""

from __future__ import annotations

from steploop.common.engine_contract import EngineChunk, EngineRequest, FinishReason, LoadReport, ModelInfo, Usage
from steploop.common.generation_defaults import GenerationDefaults
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.pooling_params import PoolingConfig, PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import TokenLogprob


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
    embed = EngineRequest("e", [1, 2], pooling=PoolingParams(dimensions=8), lora_name="adapter")
    assert EngineRequest.from_pb(embed.to_pb()) == embed


def test_usage_round_trip():
    usage = Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8)
    assert Usage.from_pb(usage.to_pb()) == usage
    chunk = engine_pb2.GenerateChunk()
    usage.to_pb(chunk.usage)   # in place, as EngineChunk.to_pb fills its chunk's
    assert Usage.from_pb(chunk.usage) == usage and Usage() == Usage(0, 0, 0)


def test_model_info_round_trip():
    info = ModelInfo("smol", max_model_len=2048, vocab_size=49152, block_size=16, num_kv_blocks=900,
                     eos_token_ids=(2, 0), num_workers=2, runner="pooling",
                     pooling=PoolingConfig("MEAN", True, 576, True, (64, 128)),
                     generation_defaults=GenerationDefaults(temperature=0.7, top_k=40, max_tokens=100),
                     lora_adapters=(("sql", "/adapters/sql"), ("chat", "/adapters/chat")))
    assert ModelInfo.from_pb(info.to_pb()) == info
    assert ModelInfo.from_pb(ModelInfo().to_pb()) == ModelInfo()   # no worker attached yet


def test_load_report_round_trip():
    load = LoadReport(num_running=3, num_waiting=4, num_free_blocks=10, num_total_blocks=64, kv_cache_usage=0.5,
                      num_steps=99, running_lora_adapters=("sql",), waiting_lora_adapters=("chat", "sql"))
    assert LoadReport.from_pb(load.to_pb()) == load   # 0.5: exact in float32


def test_chunk_round_trip_with_and_without_logprobs():
    lp = TokenLogprob(-0.5, [3, 4], [-0.25, -2.0])   # float32 on the wire: exactly representable values
    middle = EngineChunk([7, 8], [lp, lp], prompt_logprobs=[TokenLogprob(-1.0)])
    assert EngineChunk.from_pb(middle.to_pb()) == middle and not middle.finished
    last = EngineChunk([2], [lp], FinishReason.STOP, stop_token_id=2, usage=Usage(3, 5, 1))
    assert EngineChunk.from_pb(last.to_pb()) == EngineChunk([2], [lp], FinishReason.STOP, 2, Usage(3, 5, 1), "", [])
    first = EngineChunk([7], usage=Usage(3, 1, 2))   # the first chunk with tokens: usage so far (cached tokens)
    assert EngineChunk.from_pb(first.to_pb(), with_logprobs=False) == first
    assert EngineChunk.from_pb(first.to_pb()) == EngineChunk([7], [], usage=Usage(3, 1, 2), prompt_logprobs=[])
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
