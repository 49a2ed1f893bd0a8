"""PredictionSpread: how far one kind of step's real forward time strays from the StepCostModel's prediction.

The cost model is a least-squares fit: right on average, not per step. Two biases matter to prefill pacing, which
bounds a mixed step's *real* time by ratio x its decodes' *real* time: a linear model fitted over every shape sits
a few % above the plain decode steps that most observations are (measured: 43.3 ms real vs 45.5 ms predicted,
a random Qwen2.5-VL on an EPYC Zen 3), and a mixed step (prompt chunks, encoder slices) lands up to ~10% either
side of its prediction. Pacing on the raw prediction then lets p99 steps run ~1.6-1.9x at a ratio of 1.5. This
tracks actual / predicted per kind as an exponentially weighted mean and variance, so the pacer can aim at the
mean for decodes and a high quantile (mean + 2 sd) for mixed steps.
"""

from __future__ import annotations

import math


class PredictionSpread:
    def __init__(self, decay: float = 0.95, min_observations: int = 8) -> None:
        self.decay = decay                       # memory ~20 observations: follows load and thread changes
        self.min_observations = min_observations
        self.num_observations = 0
        self._weight = self._mean = self._square = 0.0

    def observe(self, actual: float, predicted: float | None) -> None:
        if not predicted or predicted <= 0.0 or not actual > 0.0:
            return
        r = actual / predicted
        d = self.decay
        self._weight = self._weight * d + 1.0
        self._mean += (r - self._mean) / self._weight
        self._square += (r * r - self._square) / self._weight
        self.num_observations += 1

    def mean(self) -> float:
        """actual / predicted on average; 1.0 until enough steps were seen."""
        return self._mean if self.num_observations >= self.min_observations else 1.0

    def upper(self) -> float:
        """mean + 2 standard deviations of actual / predicted (about the 97th percentile); 1.0 until seen."""
        if self.num_observations < self.min_observations:
            return 1.0
        return self._mean + 2.0 * math.sqrt(max(self._square - self._mean * self._mean, 0.0))
