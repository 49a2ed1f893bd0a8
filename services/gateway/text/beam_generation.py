"""Beam search through the engine: each step sends every live beam as a 1-token greedy request asking for the top
K logprobs (they are the raw model's, text/beam_search.py ranks them), all of a step's beams at once, and the n
best hypotheses come back as the prompt's n choices, one event each (text, finish reason, usage, logprobs).

Each beam's request carries the whole sequence: its prompt and shared prefix are prefix-cache hits, so a step
recomputes about one block per beam. Leaving the generator early (the client went away) cancels the step's calls,
which aborts them in the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from steploop.common.engine_contract import EngineRequest, FinishReason, Usage
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import TokenLogprob
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError
from steploop.gateway.text.beam_search import BeamConfig, Hypothesis, beam_search
from steploop.gateway.text.detokenizer import Decoder, IncrementalDetokenizer
from steploop.gateway.text.generation import Choice, TextEvent
from steploop.gateway.text.logprobs import TokenNamer


async def beam_choices(engine: EngineClient, tokenizer: Decoder, choices: Sequence[Choice], beam: BeamConfig,
                       max_tokens: int, stop_ids: frozenset[int]) -> AsyncIterator[TextEvent]:
    """choices: one prompt's n choices (same prompt and params); choice i gets the i-th best hypothesis."""
    first = choices[0]
    prompt = list(first.prompt_ids)
    user_k = first.params.logprobs
    cached: list[int] = []       # the first step's prompt-cache hits (what usage reports as cached)
    steps = 0

    async def one(request_id: str, seq: Sequence[int], k: int) -> list[tuple[int, float]]:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=max(k, user_k), ignore_eos=True)
        stream = engine.generate(EngineRequest(request_id, prompt + list(seq), params, first.priority,
                                               first.cache_salt, lora_name=first.lora_name,
                                               mm_features=list(first.mm_features)))   # the prompt's images
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.finish_reason == FinishReason.ERROR:
                        raise APIError(500, f"generation failed: {chunk.error_message or 'engine error'}",
                                       type="server_error", code="engine_error")
                    if chunk.logprobs:
                        if not seq and chunk.usage is not None:
                            cached.append(chunk.usage.cached_tokens)
                        lp = chunk.logprobs[0]
                        return list(zip(lp.top_token_ids, lp.top_logprobs))
        except APIError as err:
            if err.param == "prompt":
                err.param = first.prompt_param
            raise
        raise APIError(500, "the engine ended a beam search step without logprobs", type="server_error",
                       code="engine_error")

    async def step(seqs: Sequence[Sequence[int]], k: int) -> list[list[tuple[int, float]]]:
        nonlocal steps
        steps += 1
        tasks = [asyncio.ensure_future(one(f"{first.request_id}-beam{steps}.{i}", seq, k))
                 for i, seq in enumerate(seqs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    hypotheses = await beam_search(step, beam, max_tokens, stop_ids)
    namer = TokenNamer(tokenizer) if user_k >= 0 else None
    for choice, hyp in zip(choices, hypotheses):
        yield _event(choice, hyp, tokenizer, namer, user_k, cached[0] if cached else 0)


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
