"""Beam search over an engine that answers one token's top-k logprobs per sequence (vLLM's `use_beam_search`).

It runs in the gateway, as vLLM's frontend runs it (EngineClient.beam_search): each step sends every live beam as
a 1-token request asking for its top K logprobs, and ranks the candidates here. Beams share their prompt and common
prefix through the prefix cache (reference-counted full blocks), so a step recomputes about one block per beam. It
is not in the scheduler because there it would need forked requests in the step contract, the block pool and the C
fast path (copy-on-write of partial blocks, per-step re-ranking across requests) for a feature few clients use,
while the prefix cache already shares what matters; the cost here is one engine round trip per generated token.

The ranking is transformers' (GenerationMixin._beam_search, 4.57), so the beams equal `generate(num_beams=W,
length_penalty=..., early_stopping=...)` on the same weights:
- each step takes the top K = max(2, 1 + number of stop ids) * W of (beam score + token logprob) over all beams
  (every beam's own top K holds them, which is why K logprobs per beam suffice);
- of those, a candidate among the first W that ends the sequence (a stop id, or the last allowed token) becomes a
  finished hypothesis scored cum_logprob / generated_len ** length_penalty (generated_len counts the stop token);
  the W best hypotheses are kept;
- the first W candidates that do not end go on as the next beams;
- it stops when W hypotheses are kept and: early_stopping is true; or (false / "never") the best running beam's
  score over the length it would need (its current length; the max length for "never" with a positive penalty)
  cannot beat the worst kept hypothesis. It also stops when every candidate ended, or at max_tokens.
Scores add in float32, as transformers does, so near-ties break the same way.

vLLM's own ranking differs (its length penalty counts the prompt and it never stops early); this follows the
issue's oracle, transformers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from steploop.common.step_contract import TokenLogprob


@dataclass(frozen=True)
class BeamConfig:
    width: int                         # W beams (vLLM: best_of if given, else n)
    length_penalty: float = 1.0
    early_stopping: bool | str = False   # True, False or "never" (transformers' values)

    def candidates(self, num_stop_ids: int) -> int:
        """K: the candidates kept per step (and the top logprobs asked per beam)."""
        return max(2, 1 + num_stop_ids) * self.width


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)        # generated so far (after the prompt)
    score: np.float32 = field(default_factory=np.float32)  # cumulative logprob (0 at the start)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # each token's logprob and the top K beside it


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]                  # generated tokens, the stop token last when finish_reason is "stop"
    cum_logprob: float
    score: float                       # cum_logprob / len(tokens) ** length_penalty: what ranks them
    finish_reason: str                 # "stop" (a stop id) or "length" (max_tokens)
    logprobs: list[TokenLogprob]


# One step: the top-K logprobs of the next token after each sequence (generated tokens only; the caller adds the
# prompt), in the beams' order, most likely first.
StepFn = Callable[[Sequence[Sequence[int]], int], Awaitable[list[list[tuple[int, float]]]]]


async def beam_search(step: StepFn, config: BeamConfig, max_tokens: int,
                      stop_ids: frozenset[int]) -> list[Hypothesis]:
    """The W best hypotheses, best first (fewer only if fewer sequences exist)."""
    width, penalty, early = config.width, config.length_penalty, config.early_stopping
    k = config.candidates(len(stop_ids))
    running = [Beam()]       # transformers starts W copies of the prompt with all but one at -1e9: the same
    finished: list[Hypothesis] = []
    for t in range(max_tokens):
        tops = await step([b.tokens for b in running], k)
        cands = []           # (score, beam order, rank in its top) so ties keep transformers' flat-index order
        for i, (beam, top) in enumerate(zip(running, tops)):
            for rank, (token, lp) in enumerate(top):
                cands.append((np.float32(beam.score + np.float32(lp)), i, rank, token, lp))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:k]
        last = t + 1 == max_tokens
        gen_len = t + 1
        ends = [last or c[3] in stop_ids for c in cands]
        for c, end in zip(cands[:width], ends[:width]):
            if end:
                beam = _extend(running, tops, c)
                score = float(np.float32(c[0] / np.float32(gen_len ** penalty)))
                reason = "stop" if c[3] in stop_ids else "length"
                finished.append(Hypothesis(beam.tokens, float(c[0]), score, reason, beam.logprobs))
        finished.sort(key=lambda h: -h.score)        # stable: an earlier hypothesis wins a tie, as topk's merge
        del finished[width:]
        running = [_extend(running, tops, c) for c, end in zip(cands, ends) if not end][:width]
        if last or not running or all(ends):
            break
        if len(finished) == width:
            if early is True:
                break
            best_len = max_tokens if early == "never" and penalty > 0 else gen_len
            best_possible = np.float32(running[0].score / np.float32(best_len ** penalty))
            if not best_possible > min(h.score for h in finished):
                break
    return finished


def _extend(running: list[Beam], tops: list[list[tuple[int, float]]], cand: tuple) -> Beam:
    """The beam a candidate (score, parent index, rank, token, logprob) makes: its parent plus the token."""
    parent, top = running[cand[1]], tops[cand[1]]
    lp = TokenLogprob(float(cand[4]), [tok for tok, _ in top], [x for _, x in top])
    return Beam(parent.tokens + [cand[3]], cand[0], parent.logprobs + [lp])
