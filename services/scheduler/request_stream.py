"""RequestStream: one Generate caller's view of a live request: an asyncio queue that the step loop fills.

The step loop puts RequestOutputs; the Generate handler drains everything available at once and merges it into
one EngineChunk, so a slow client costs one message per wake-up, not one per token. Session requests have their
own sink (session.py); both merge outputs with `merge`, and their servicers convert the chunk for the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from steploop.common.engine_contract import EngineChunk, FinishReason, Usage
from steploop.common.errors import EngineError
from steploop.scheduler.beam_groups import BeamOutput
from steploop.scheduler.request import RequestStatus
from steploop.scheduler.request_failures import RejectedOutput

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
}


@dataclass
class FailedOutput:
    """Ends a stream with a gRPC error instead of a chunk (the request never ran, or its worker never came back)."""
    request_id: str
    error: EngineError


class OutputSink(Protocol):
    """Where the step loop puts a live request's RequestOutputs (and a FailedOutput)."""
    def put(self, output) -> None: ...


def merge(outputs: Sequence) -> EngineChunk:
    """One chunk of outputs, oldest first (the last one says whether the request finished). The chunk with the
    request's first tokens carries usage too, so a caller that stops reading early (a stop string) knows its
    cached tokens. Raises a FailedOutput's error."""
    tokens, logprobs, prompt_logprobs = [], [], []
    chunk = EngineChunk(tokens, logprobs, prompt_logprobs=prompt_logprobs)
    for out in outputs:
        if isinstance(out, FailedOutput):
            raise out.error
        tokens += out.new_token_ids
        if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):   # its first: prefix hit known
            chunk.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            prompt_logprobs += out.prompt_logprobs
        if out.logprobs:
            logprobs += out.logprobs
        if out.finish_reason is not None:
            chunk.finish_reason = FINISH_REASONS[out.finish_reason]
            chunk.stop_token_id = out.stop_token_id or 0
            chunk.error_message = out.error or ""
            if isinstance(out, RejectedOutput):
                chunk.error_code, chunk.error_param = out.error_code, out.error_param
            chunk.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
            if out.embedding is not None:
                chunk.embedding = out.embedding
            if isinstance(out, BeamOutput) and out.beams is not None:
                chunk.beams = out.beams
    return chunk


def is_final(output) -> bool:
    return isinstance(output, FailedOutput) or output.finish_reason is not None


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, output) -> None:
        self.queue.put_nowait(output)

    async def next_chunk(self) -> EngineChunk:
        """Waits for at least one output, then merges all that are queued into one chunk.

        Raises the EngineError of a FailedOutput."""
        outputs = [await self.queue.get()]
        while not self.queue.empty():
            outputs.append(self.queue.get_nowait())
        try:
            chunk = merge(outputs)
        except EngineError:
            self.finished = True
            raise
        self.finished = chunk.finished
        return chunk
