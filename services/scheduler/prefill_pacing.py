"""PrefillPacer: prompt chunks may slow a step that also decodes by at most a set ratio (stall-free batching).

A fixed token budget protects inter-token latency only on the hardware it was tuned for: 2048 prompt tokens
beside a few decodes cost ~2x a decode step on a large GPU but ~50x on a 2-core CPU. Like Sarathi-Serve, the
pacer turns a latency bound into a token count, but online: a StepCostModel learns each step's forward time from
its shape, and in a step with decodes the prompt chunks together get at most

    (ratio - 1) * predicted time of the step's decodes alone

of extra predicted time. Steps without decodes (nothing is streaming) keep the whole budget, and a step always
gets at least `min_chunk` prompt tokens so prompts progress however small the allowance. Until the model has seen
enough steps nothing is capped.

Images (vision-language models) count too: a chunk that reaches an image not yet encoded pays the image's whole
encoder run in this step, e * its encoder tokens (the model learns e as it learns the per-token cost). The chunk
stops before an image the allowance left cannot pay for, so the image waits for a step with room. An image
larger than a whole step's allowance runs anyway when its chunk gets the `min_chunk` progress guarantee as the
step's first prompt work; that spends the allowance, so it runs with the decodes and no other prompt chunk rather
than never (a guaranteed chunk after other prompt work stops before an unpaid image). A tower that runs a slice
of layers per step (encoder_budget.py) never needs that: a running request's chunk always stops before an unpaid
image, and the slices, which the allowance pays for (encoder_tokens_affordable / spend_encoder), finish it.

The decode part of the step being built is not known until the running queue has been walked, so the allowance
is derived from the previous step's decodes (one token of context apart, the same), scaled down to the requests
still running.

The bound is on real time, the model's fit is right on average: the allowance is corrected by how real steps
stray from their predictions (prediction_spread.py), decodes at their mean and mixed steps at a high quantile,

    allowance = (ratio * decode_mean / mixed_upper - 1) * predicted time of the decodes alone

so a step with prompt work stays within the ratio at the tail (p99 ITL), not only on average. The correction
never takes more than half of the uncorrected allowance (nor adds to it).
"""

from __future__ import annotations

import math

from steploop.scheduler.prediction_spread import PredictionSpread
from steploop.scheduler.step_cost import StepCostModel, attention_pairs


class PrefillPacer:
    def __init__(self, ratio: float, min_chunk: int, cost: StepCostModel | None = None) -> None:
        self.ratio = ratio
        self.min_chunk = min_chunk
        self.cost = cost or StepCostModel()
        self._allowance: float | None = None       # seconds of prompt work left in this step; None = no cap
        self._full_allowance = 0.0                 # what it was when the step began
        self._min_left = 0                         # tokens still guaranteed this step (progress)
        self._coef: tuple[float, float, float] | None = None
        self._decode_tokens = 0                    # this step's decodes, tallied while it is built
        self._decode_pairs = 0.0
        self._step_tokens = 0                      # this step's whole shape, for the observation
        self._step_pairs = 0.0
        self._step_encoder = 0                     # encoder tokens of the images this step encodes
        self._encoder_seconds = 0.0                # e: seconds per encoder token, this step
        # step_id -> (tokens, pairs, encoder tokens, the spread it informs, the time it was paced by), until its
        # result arrives
        self._shapes: dict[int, tuple[int, float, int, PredictionSpread | None, float]] = {}
        self.decode_spread = PredictionSpread()    # real / predicted time of steps with decodes only
        self.mixed_spread = PredictionSpread()     # ... of steps with decodes and prompt or encoder work
        self.num_paced_steps = 0                   # steps in which pacing cut a prompt chunk (metrics)
        self.num_deferred_tokens = 0               # per step, prompt tokens held back by those cuts, summed
        self._cut_this_step = False

    # ---------------------------------------------------------------- building a step
    def begin_step(self, num_running: int) -> None:
        """num_running: requests running now; fewer than last step's decodes means some of those finished."""
        decodes, pairs = self._decode_tokens, self._decode_pairs
        self._decode_tokens, self._decode_pairs, self._step_tokens, self._step_pairs = 0, 0.0, 0, 0.0
        self._step_encoder = 0
        self._allowance = None
        self._cut_this_step = False
        if decodes > num_running:
            pairs, decodes = pairs * num_running / decodes, num_running
        if decodes == 0:
            return
        self._coef = self.cost.coefficients()
        if self._coef is None:
            return
        a, b, c = self._coef
        self._encoder_seconds = self.cost.encoder_token_seconds()
        # The correction takes at most half the allowance: on a machine shared with noisy neighbours the spread is
        # their noise, which pacing cannot remove, and prompts must still progress faster than min_chunk a step.
        target = self.ratio * self.decode_spread.mean() / self.mixed_spread.upper()
        target = min(max(target, 1.0 + (self.ratio - 1.0) / 2), self.ratio)
        self._allowance = self._full_allowance = (target - 1.0) * (a + b * decodes + c * pairs)
        self._min_left = self.min_chunk

    def clip(self, num_new: int, start: int, images: list[tuple[int, int]] = (), sliceable: bool = False) -> int:
        """A prompt chunk of up to num_new tokens from position `start`: the tokens the allowance leaves it.
        images: (offset, encoder tokens) of the images the whole chunk would encode (EncoderBudget.to_encode).
        sliceable: the encoder runs a slice of layers per step (encoder_budget.py), so the progress guarantee never
        carries a chunk into an image the allowance does not pay for: slices finish it instead."""
        if self._allowance is None or num_new <= 0:
            return num_new
        k = paid = self._within_allowance(num_new, start, images)
        if k < self._min_left:
            k = min(num_new, self._min_left)
            if sliceable or self._allowance < self._full_allowance:
                # An earlier chunk spent part of this step: an image the allowance did not pay for waits for a
                # step whose allowance it opens (then the guarantee carries it, alone with the decodes).
                unpaid = [o for o, _ in images if (paid == 0 or o >= start + paid) and o < start + k]
                if unpaid:
                    k = max(unpaid[0] - start, paid)
        self._min_left = max(self._min_left - k, 0)
        if k < num_new:
            self.num_deferred_tokens += num_new - k
            if not self._cut_this_step:
                self._cut_this_step = True
                self.num_paced_steps += 1
        _, b, c = self._coef
        encoder = sum(length for offset, length in images if offset < start + k) if k else 0
        spent = b * k + c * attention_pairs(k, start + k) + self._encoder_seconds * encoder
        self._allowance = max(self._allowance - spent, 0.0)
        return k

    def _within_allowance(self, num_new: int, start: int, images) -> int:
        """Largest k <= num_new whose tokens plus the images they reach fit the allowance; a chunk that cannot
        pay for an image stops before it."""
        left = self._allowance
        for offset, length in images:
            before = max(offset - start, 0)
            if before >= num_new or self._tokens_within(left, start) <= before:
                break                                  # the chunk ends before this image
            left -= self._encoder_seconds * length
            if self._tokens_within(left, start) <= before:
                return before
        return min(num_new, self._tokens_within(left, start))

    def _tokens_within(self, seconds: float, start: int) -> int:
        """Largest k with b*k + c*k*(start + (k + 1)/2) <= seconds (the chunk's matmul and attention time)."""
        if seconds <= 0.0:
            return 0
        _, b, c = self._coef
        lin = b + c * (start + 0.5)
        if c <= 0.0:
            return int(seconds / lin) if lin > 0.0 else 1 << 30
        return int((-lin + math.sqrt(lin * lin + 2.0 * c * seconds)) / c)

    def encoder_tokens_affordable(self) -> int | None:
        """Encoder tokens (a slice of an image's tower: encoder_budget.py) the step's allowance still pays for;
        None: no cap (no decodes in the step, the model not fitted, or no image encoded yet)."""
        if self._allowance is None or self._encoder_seconds <= 0.0:
            return None
        return int(self._allowance / self._encoder_seconds)

    def spend_encoder(self, encoder_tokens: int) -> None:
        """A slice of encoder_tokens runs this step: its time comes out of the allowance and into the shape."""
        self._step_encoder += encoder_tokens
        if self._allowance is not None:
            self._allowance = max(self._allowance - self._encoder_seconds * encoder_tokens, 0.0)

    def tally(self, num_new: int, context_end: int, is_decode: bool, encoder_tokens: int = 0) -> None:
        """A request was added to the step being built with num_new tokens ending at context_end (and images of
        encoder_tokens to encode)."""
        pairs = num_new * (context_end - (num_new - 1) * 0.5)      # attention_pairs, inlined: once per request
        self._step_tokens += num_new
        self._step_encoder += encoder_tokens
        self._step_pairs += pairs
        if is_decode:
            self._decode_tokens += num_new
            self._decode_pairs += pairs

    def tally_decodes(self, num_decodes: int, context: int) -> None:
        """tally(1, end, True) for num_decodes decodes at once, `context` the sum of their ends (exact: the
        pairs of one decode are its end, an integer)."""
        self._step_tokens += num_decodes
        self._step_pairs += context
        self._decode_tokens += num_decodes
        self._decode_pairs += context

    def end_step(self, step_id: int) -> None:
        if not self._step_tokens:
            return
        spread, predicted = None, 0.0
        if self._allowance is not None and self._decode_tokens:     # paced: how far its real time will stray
            decodes_only = self._step_tokens == self._decode_tokens and not self._step_encoder
            spread = self.decode_spread if decodes_only else self.mixed_spread
            a, b, c = self._coef
            predicted = a + b * self._step_tokens + c * self._step_pairs + self._encoder_seconds * self._step_encoder
        self._shapes[step_id] = (self._step_tokens, self._step_pairs, self._step_encoder, spread, predicted)

    # ---------------------------------------------------------------- results
    def observe(self, step_id: int, forward_seconds: float) -> None:
        shape = self._shapes.pop(step_id, None)
        if shape is None:
            return
        tokens, pairs, encoder, spread, predicted = shape
        if spread is not None:
            spread.observe(forward_seconds, predicted)
        self.cost.observe(tokens, pairs, forward_seconds, encoder)

    def forget_in_flight(self) -> None:
        """Plans sent to a lost worker never report back."""
        self._shapes.clear()
