"""Beam search's ranking (vLLM's `use_beam_search`), one step at a time: what the scheduler's beam groups run
(scheduler/beam_groups.py) over the top-K logprobs the worker returns for each live beam.

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
Scores add in float32, as transformers does, so near-ties break the same way. float32 is emulated in Python (`_f32`:
an operation on two float32 values done in double and rounded once to float32 is exactly the float32 operation for
+ and /, since 53 >= 2 * 24 + 2 bits), so the scheduler, which runs this, needs no numpy (its image has none).

vLLM's own ranking differs (its length penalty counts the prompt and it never stops early); this follows the
issue's oracle, transformers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

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
    score: float = 0.0                 # cumulative logprob, a float32 value (0 at the start)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # each token's logprob and the top K beside it
    parent: int = 0                    # index of the beam it extends in the previous step's running list


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]                  # generated tokens, the stop token last when finish_reason is "stop"
    cum_logprob: float
    score: float                       # cum_logprob / len(tokens) ** length_penalty: what ranks them
    finish_reason: str                 # "stop" (a stop id) or "length" (max_tokens)
    logprobs: list[TokenLogprob]


class BeamRanking:
    """One search: `running` are the live beams (one empty beam at the start: transformers starts W copies of the
    prompt with all but one at -1e9, the same); `step(tops)` ranks their candidates; `finished` holds the W best
    hypotheses, best first, once `done`."""

    def __init__(self, config: BeamConfig, max_tokens: int, stop_ids: frozenset[int]) -> None:
        self.config, self.max_tokens, self.stop_ids = config, max_tokens, stop_ids
        self.k = config.candidates(len(stop_ids))
        self.running: list[Beam] = [Beam()]
        self.finished: list[Hypothesis] = []
        self.t = 0
        self.done = max_tokens <= 0

    def step(self, tops: list[list[tuple[int, float]]]) -> None:
        """tops[i]: the top-K (token, logprob) after running[i], most likely first. Afterwards `running` are the
        next beams (each knows its parent's index) unless `done`."""
        config, width, k = self.config, self.config.width, self.k
        running = self.running
        cands = []           # (score, beam order, rank in its top) so ties keep transformers' flat-index order
        for i, (beam, top) in enumerate(zip(running, tops)):
            for rank, (token, lp) in enumerate(top):
                cands.append((_f32(beam.score + _f32(lp)), i, rank, token, lp))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:k]
        self.t += 1
        last = self.t == self.max_tokens
        gen_len = self.t
        ends = [last or c[3] in self.stop_ids for c in cands]
        finished = self.finished
        for c, end in zip(cands[:width], ends[:width]):
            if end:
                beam = _extend(running, tops, c)
                score = _f32(c[0] / _f32(gen_len ** config.length_penalty))
                reason = "stop" if c[3] in self.stop_ids else "length"
                finished.append(Hypothesis(beam.tokens, float(c[0]), score, reason, beam.logprobs))
        finished.sort(key=lambda h: -h.score)        # stable: an earlier hypothesis wins a tie, as topk's merge
        del finished[width:]
        self.running = [_extend(running, tops, c) for c, end in zip(cands, ends) if not end][:width]
        self.done = last or not self.running or all(ends) or self._cannot_improve(gen_len)

    def _cannot_improve(self, gen_len: int) -> bool:
        penalty, early = self.config.length_penalty, self.config.early_stopping
        if len(self.finished) < self.config.width:
            return False
        if early is True:
            return True
        best_len = self.max_tokens if early == "never" and penalty > 0 else gen_len
        best_possible = _f32(self.running[0].score / _f32(best_len ** penalty))
        return not best_possible > min(h.score for h in self.finished)


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (numpy's np.float32(x), without numpy)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _extend(running: list[Beam], tops: list[list[tuple[int, float]]], cand: tuple) -> Beam:
    """The beam a candidate (score, parent index, rank, token, logprob) makes: its parent plus the token."""
    parent, top = running[cand[1]], tops[cand[1]]
    lp = TokenLogprob(float(cand[4]), [tok for tok, _ in top], [x for _, x in top])
    return Beam(parent.tokens + [cand[3]], cand[0], parent.logprobs + [lp], cand[1])
