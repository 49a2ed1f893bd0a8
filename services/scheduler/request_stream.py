"""RequestStream: one Generate caller's view of a live request: an asyncio queue that the step loop fills.

The step loop puts RequestOutputs; the Generate handler drains everything available at once and merges it into
one chunk, so a slow client costs one message per wake-up, not one per token. Session requests have their own
sink (session.py); both merge outputs with `merge_into`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import EngineError
from services.common.pb.steploop.v1 import engine_pb2
from services.scheduler.request import RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: engine_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: engine_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_ERROR: engine_pb2.FINISH_REASON_ERROR,
}


@dataclass
class FailedOutput:
    """Ends a stream with a gRPC error instead of a chunk (the request never ran, or its worker never came back)."""
    request_id: str
    error: EngineError


class OutputSink(Protocol):
    """Where the step loop puts a live request's RequestOutputs (and a FailedOutput)."""
    def put(self, output) -> None: ...


def merge_into(chunk: engine_pb2.GenerateChunk, outputs: Sequence) -> bool:
    """Appends outputs, oldest first, to chunk; True when the request finished. Raises a FailedOutput's error."""
    finished = False
    for out in outputs:
        if isinstance(out, FailedOutput):
            raise out.error
        chunk.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            chunk.prompt_logprobs.extend(lp.to_pb() for lp in out.prompt_logprobs)
        for lp in out.logprobs or []:
            chunk.logprobs.append(lp.to_pb())
        if out.finish_reason is not None:
            finished = True
            chunk.finish_reason = FINISH_REASONS[out.finish_reason]
            chunk.stop_token_id = out.stop_token_id or 0
            chunk.error_message = out.error or ""
            chunk.usage.prompt_tokens = out.num_prompt_tokens
            chunk.usage.completion_tokens = out.num_output_tokens
            chunk.usage.cached_tokens = out.num_cached_tokens
    return finished


def is_final(output) -> bool:
    return isinstance(output, FailedOutput) or output.finish_reason is not None


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, output) -> None:
        self.queue.put_nowait(output)

    async def next_chunk(self) -> engine_pb2.GenerateChunk:
        """Waits for at least one output, then merges all that are queued into one chunk.

        Raises the EngineError of a FailedOutput."""
        outputs = [await self.queue.get()]
        while not self.queue.empty():
            outputs.append(self.queue.get_nowait())
        chunk = engine_pb2.GenerateChunk()
        try:
            self.finished = merge_into(chunk, outputs)
        except EngineError:
            self.finished = True
            raise
        return chunk
