"""Beam search through the engine: one request carrying the beam width (EngineRequest.beam); the scheduler runs
the search (scheduler/beam_groups.py: beams sharing their prefix blocks, ranked each step by
common/beam_ranking.py) and its last chunk carries the hypotheses, best first. Choice i gets the i-th best, one
event each (text, finish reason, usage, logprobs). Leaving the generator early (the client went away) closes the
stream, which aborts the request, and with it every beam, in the scheduler."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from steploop.common.beam_ranking import BeamConfig, Hypothesis
from steploop.common.engine_contract import EngineRequest, FinishReason, Usage
from steploop.common.step_contract import TokenLogprob
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError
from steploop.gateway.grammar_check import rejected
from steploop.gateway.text.detokenizer import Decoder, IncrementalDetokenizer
from steploop.gateway.text.generation import Choice, TextEvent
from steploop.gateway.text.logprobs import TokenNamer


async def beam_choices(engine: EngineClient, tokenizer: Decoder, choices: Sequence[Choice], beam: BeamConfig,
                       max_tokens: int) -> AsyncIterator[TextEvent]:
    """choices: one prompt's n choices (same prompt and params); choice i gets the i-th best hypothesis."""
    first = choices[0]
    user_k = first.params.logprobs
    params = dataclasses.replace(first.params, max_tokens=max_tokens)
    stream = engine.generate(EngineRequest(first.request_id, list(first.prompt_ids), params, first.priority,
                                           first.cache_salt, lora_name=first.lora_name,
                                           mm_features=list(first.mm_features), beam=beam))
    final = None
    try:
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.finished:
                    final = chunk
                    break
    except APIError as err:
        if err.param == "prompt":
            err.param = first.prompt_param
        raise
    if final is None:
        raise APIError(500, "the engine ended a beam search without a finish reason", type="server_error",
                       code="engine_error")
    if final.finish_reason == FinishReason.REJECTED:
        raise rejected(final, first.constraint_param)
    if final.finish_reason == FinishReason.ERROR:
        raise APIError(500, f"generation failed: {final.error_message or 'engine error'}", type="server_error",
                       code="engine_error")
    cached = final.usage.cached_tokens if final.usage is not None else 0
    if final.finish_reason == FinishReason.ABORT:     # the engine gave up on it (shutdown): no beam to show
        for choice in choices:
            yield TextEvent(choice.index, "", "abort", Usage(len(choice.prompt_ids), 0, cached), None)
        return
    namer = TokenNamer(tokenizer) if user_k >= 0 else None
    for choice, hyp in zip(choices, final.beams):
        yield _event(choice, hyp, tokenizer, namer, user_k, cached)


def _event(choice: Choice, hyp: Hypothesis, tokenizer: Decoder, namer: TokenNamer | None, k: int,
           cached: int) -> TextEvent:
    ids = hyp.tokens
    if hyp.finish_reason == "stop" and not choice.include_stop_str_in_output:
        ids = ids[:-1]     # the stop token is counted, not shown, as for sampled choices
    detok = IncrementalDetokenizer(tokenizer, choice.prompt_ids, choice.skip_special_tokens)
    text = detok.add(ids) + detok.flush()
    logprobs = None
    if namer is not None:
        logprobs = tuple(namer.info(t, TokenLogprob(lp.logprob, lp.top_token_ids[:k], lp.top_logprobs[:k]))
                         for t, lp in zip(hyp.tokens, hyp.logprobs))
    usage = Usage(len(choice.prompt_ids), len(hyp.tokens), cached)
    return TextEvent(choice.index, text, hyp.finish_reason, usage, logprobs)
