"""What one step's outputs become on a Session stream: one entry per request, errors as RequestError, and large
steps split into messages under the size limit without losing or reordering anything."""

from __future__ import annotations

import grpc

from steploop.common.errors import InvalidRequestError, OverloadedError
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.step_contract import TokenLogprob
from steploop.scheduler.request import RequestOutput, RequestStatus
from steploop.scheduler.request_stream import FailedOutput
from steploop.scheduler.session import outputs_messages


def output(rid: str, tokens: list[int], finish=None, prompt_logprobs=None, num_output: int = 1) -> RequestOutput:
    return RequestOutput(rid, tokens, None, finish, None, 3, num_output, 0, prompt_logprobs=prompt_logprobs)


def test_one_entry_per_request_merging_its_outputs_in_order():
    pending = {"a": [output("a", [1]), output("a", [2, 3], RequestStatus.FINISHED_LENGTH, num_output=3)], "b": [output("b", [7])]}
    [message] = outputs_messages(pending)
    a, b = message.chunks
    assert (a.request_id, list(a.chunk.token_ids), a.chunk.finish_reason) == ("a", [1, 2, 3],
                                                                             engine_pb2.FINISH_REASON_LENGTH)
    assert a.chunk.usage.completion_tokens == 3
    assert (b.request_id, list(b.chunk.token_ids), b.chunk.finish_reason) == ("b", [7], 0)


def test_errors_become_request_errors():
    pending = {"bad": [FailedOutput("bad", InvalidRequestError("too long", param="max_tokens",
                                                               code="context_length_exceeded"))],
               "busy": [FailedOutput("busy", OverloadedError("queue full"))]}
    bad, busy = outputs_messages(pending)[0].chunks
    assert not bad.HasField("chunk")
    assert (bad.error.status_code, bad.error.message, bad.error.code, bad.error.param) == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0], "too long", "context_length_exceeded", "max_tokens")
    assert (busy.error.status_code, busy.error.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 1)


def test_a_large_step_is_split_under_the_limit_in_order():
    big = [TokenLogprob(-0.5, list(range(20)), [-1.0] * 20) for _ in range(200)]   # ~30 KB of prompt logprobs
    pending = {f"r{i}": [output(f"r{i}", [i], prompt_logprobs=big if i % 3 == 0 else None)] for i in range(30)}
    messages = outputs_messages(pending, max_bytes=64 * 1024)
    assert len(messages) > 1
    assert all(m.ByteSize() <= 64 * 1024 + 1024 for m in messages)
    entries = [e for m in messages for e in m.chunks]
    assert [e.request_id for e in entries] == [f"r{i}" for i in range(30)]
    assert [list(e.chunk.token_ids) for e in entries] == [[i] for i in range(30)]
    assert [len(e.chunk.prompt_logprobs) for e in entries] == [200 if i % 3 == 0 else 0 for i in range(30)]
