"""Beam search driven from the gateway: each step sends every live beam as a 1-token request asking for its top K
logprobs (vLLM's frontend way), ranked by common/beam_ranking.py. Kept only to measure against the scheduler's
beam groups; the serving path is scheduler/beam_groups.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from steploop.common.beam_ranking import BeamConfig, BeamRanking, Hypothesis

__all__ = ["BeamConfig", "Hypothesis", "beam_search"]

StepFn = Callable[[Sequence[Sequence[int]], int], Awaitable[list[list[tuple[int, float]]]]]


async def beam_search(step: StepFn, config: BeamConfig, max_tokens: int,
                      stop_ids: frozenset[int]) -> list[Hypothesis]:
    """The W best hypotheses, best first (fewer only if fewer sequences exist)."""
    ranking = BeamRanking(config, max_tokens, stop_ids)
    while not ranking.done:
        ranking.step(await step([b.tokens for b in ranking.running], ranking.k))
    return ranking.finished
