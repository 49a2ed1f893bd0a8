"""From token ids to text events: one engine call per choice, detokenized, cut at stop strings, merged.

Each choice is an async generator of `TextEvent`s. Leaving it early (a stop string matched, the HTTP client went
away) closes the engine call, which aborts the request in the scheduler: cancellation is abort, no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from steploop.common.beam_ranking import BeamConfig
from steploop.common.engine_contract import EngineChunk, EngineRequest, FinishReason, Usage
from steploop.common.sampling_params import SamplingParams
from steploop.gateway import request_class
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError
from steploop.gateway.grammar_check import rejected
from steploop.gateway.text.detokenizer import Decoder, IncrementalDetokenizer
from steploop.gateway.text.logprobs import TokenInfo, TokenNamer, vllm_prompt_logprobs
from steploop.gateway.text.stop_strings import StopStringMatcher

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclass(frozen=True)
class Choice:
    """One engine request: the i-th choice of an HTTP request."""
    index: int
    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: bool = False               # completions: the prompt text (and its logprobs) comes first
    prompt_text: str | None = None   # the prompt as sent, for echo (None: decoded from prompt_ids)
    drop_output: bool = False        # max_tokens 0 with echo: the one token the engine samples is dropped
    priority: int = 0
    cache_salt: str = ""             # tenants with different salts share no prefix-cache blocks
    disaggregation: str = ""         # "" (the scheduler's rule), "disaggregated" or "local" (prefill/decode groups)
    prompt_param: str = "prompt"     # the request field an engine error about the prompt names ("messages": chat)
    lora_name: str = ""              # the LoRA adapter it runs with ("" = the base model)
    constraint_param: str = ""       # the request field of its structured-output constraint (a REJECTED 400 names it)
    prompt_logprobs: int = -1        # vLLM's prompt_logprobs (k >= 0): they come in the choice's first event
    mm_features: tuple = ()          # its images (common/mm_inputs.py MultiModalFeature), placeholders expanded
    beam: BeamConfig | None = None   # this prompt's choices are its best beams (beam_generation.py)
    prompt_index: int = 0            # which of the request's prompts it is (its beams are searched once)


@dataclass(frozen=True)
class TextEvent:
    index: int                       # choice index
    text: str                        # new text since this choice's previous event (may be "" on the last)
    finish_reason: str | None = None  # set on the choice's last event
    usage: Usage | None = None        # set on the choice's last event
    logprobs: tuple[TokenInfo, ...] | None = None   # tokens behind this text, when logprobs were asked for
    stop_str: str | None = None       # the stop string that ended the choice (Anthropic's stop_sequence)
    reasoning: str = ""               # thinking split off `text` by --reasoning-parser (reasoning.py)
    prompt_logprobs: list[dict[str, Any] | None] | None = None   # vLLM's shape (logprobs.vllm_prompt_logprobs)


async def generate_choice(engine: EngineClient, tokenizer: Decoder, choice: Choice) -> AsyncIterator[TextEvent]:
    """Token logprobs ride on the next event that carries text (text held back by a stop string waits too)."""
    detok = IncrementalDetokenizer(tokenizer, choice.prompt_ids, choice.skip_special_tokens)
    stops = StopStringMatcher(choice.stop, choice.include_stop_str_in_output)
    namer = TokenNamer(tokenizer) if choice.params.logprobs >= 0 else None
    pending: list[TokenInfo] = []
    num_tokens, first, cached = 0, True, 0   # cached: from the usage on the first chunk with tokens
    prompt_lps_due = choice.prompt_logprobs >= 0
    prompt_lps: list | None = None       # vLLM's prompt_logprobs, until the next event carries them

    def carry(event: TextEvent) -> TextEvent:
        """Puts the prompt logprobs on the first event that goes out after they came (an event of their own
        would be dropped by filters that pass only events with text, e.g. the reasoning splitter)."""
        nonlocal prompt_lps
        if prompt_lps is None:
            return event
        event, prompt_lps = dataclasses.replace(event, prompt_logprobs=prompt_lps), None
        return event

    stream = engine.generate(EngineRequest(choice.request_id, list(choice.prompt_ids), choice.params, choice.priority,
                                           choice.cache_salt, lora_name=choice.lora_name,
                                           mm_features=list(choice.mm_features),
                                           background=request_class.is_background(),
                                           disaggregation=choice.disaggregation))
    try:
        async with contextlib.aclosing(stream):   # leaving this block cancels the call, i.e. aborts the request
            async for chunk in stream:
                if prompt_lps_due and chunk.token_ids:       # they ride on the first chunk with a token
                    prompt_lps_due = False
                    prompt_lps = vllm_prompt_logprobs(namer or TokenNamer(tokenizer), choice.prompt_ids,
                                                      chunk.prompt_logprobs, choice.prompt_logprobs)
                if first and choice.echo:
                    yield carry(echo_event(choice, tokenizer, namer, chunk))
                first = False
                if chunk.usage is not None:
                    cached = chunk.usage.cached_tokens
                ids = chunk.token_ids if not choice.drop_output else []
                num_tokens += len(ids)
                if namer is not None:
                    pending.extend(namer.info(t, lp) for t, lp in zip(ids, chunk.logprobs))
                finish = chunk.finish_reason
                if finish == FinishReason.STOP and not choice.include_stop_str_in_output:
                    ids = ids[:-1]   # the stop token (EOS or one of stop_token_ids) is counted but not shown, as vLLM
                delta = detok.add(ids)
                if finish:
                    delta += detok.flush()    # it ended on half a character: that comes out as decode() renders it
                text = stops.feed(delta)
                lps = tuple(pending) if namer is not None and (text or finish or stops.stopped) else None
                if lps is not None:
                    pending = []
                if stops.stopped:
                    usage = Usage(len(choice.prompt_ids), num_tokens, cached)
                    yield carry(TextEvent(choice.index, text, "stop", usage, lps, stops.matched))
                    return
                if not finish:
                    if text:
                        yield carry(TextEvent(choice.index, text, logprobs=lps))
                    continue
                if finish == FinishReason.REJECTED:    # the worker cannot serve it as asked: the client's error
                    raise rejected(chunk, choice.constraint_param)
                if finish == FinishReason.ERROR:
                    raise APIError(500, f"generation failed: {chunk.error_message or 'engine error'}",
                                   type="server_error", code="engine_error")
                usage = Usage(chunk.usage.prompt_tokens or len(choice.prompt_ids),
                              num_tokens if choice.drop_output else chunk.usage.completion_tokens or num_tokens,
                              chunk.usage.cached_tokens)
                finish_name = "length" if choice.drop_output else FINISH_REASONS[finish]
                yield carry(TextEvent(choice.index, text + stops.flush(), finish_name, usage, lps))
                return
    except APIError as err:
        if err.param == "prompt":   # the engine names its own field; chat's prompt is the messages
            err.param = choice.prompt_param
        raise
    raise APIError(500, "the engine ended the stream without a finish reason", type="server_error",
                   code="engine_error")


def echo_event(choice: Choice, tokenizer: Decoder, namer: TokenNamer | None,
               chunk: EngineChunk) -> TextEvent:
    """The prompt as the choice's first text; with logprobs, each prompt token's (the first has none)."""
    text = choice.prompt_text if choice.prompt_text is not None else tokenizer.decode(choice.prompt_ids)
    lps = None
    if namer is not None:
        ids = choice.prompt_ids
        lps = (namer.info(ids[0], None),) + tuple(namer.info(t, lp) for t, lp in zip(ids[1:], chunk.prompt_logprobs))
    return TextEvent(choice.index, text, logprobs=lps)


async def merge(streams: Sequence[AsyncIterator[TextEvent]]) -> AsyncIterator[TextEvent]:
    """Interleaves several choices' events as they come. Closing the merge closes (aborts) every choice."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for event in streams[0]:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[TextEvent]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    queue.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(usages: dict[int, Usage], n: int) -> Usage:
    """Sums completion tokens over all choices; prompt tokens once per prompt (choice indices i*n .. i*n+n-1)."""
    total = Usage()
    for index, usage in usages.items():
        total.completion_tokens += usage.completion_tokens
        if index % n == 0:
            total.prompt_tokens += usage.prompt_tokens
            total.cached_tokens += usage.cached_tokens
    return total
