"""StepCostModel: predicts a step's forward time from its shape, learned online from the worker's timings.

    seconds ~= a + b * tokens + c * attention_pairs

`tokens` is the step's scheduled token count (what the matmuls scale with) and `attention_pairs` the number of
(query, key) pairs its attention computes: a chunk of k new tokens ending at context length L adds
k * (L - (k - 1) / 2), a decode at context L adds L. The weights are an exponentially weighted least-squares fit
(recent steps count most, so the model follows load, thermal and thread changes) with a small ridge term that
keeps it solvable while every step looks alike (steady decoding). Pure Python: three normal equations.
"""

from __future__ import annotations

# Features are scaled so the normal equations are well conditioned: tokens in thousands, pairs in millions.
_SCALE = (1.0, 1e-3, 1e-6)


def attention_pairs(num_new: int, context_end: int) -> float:
    """(query, key) pairs of a causal chunk of num_new tokens whose last one sits at context_end - 1."""
    return num_new * (context_end - (num_new - 1) / 2)


class StepCostModel:
    def __init__(self, decay: float = 0.998, min_observations: int = 8, ridge: float = 1e-5) -> None:
        self.decay = decay                    # weight of an observation falls by this per later step (memory ~500 steps)
        self.min_observations = min_observations
        self.ridge = ridge
        self.num_observations = 0
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._coef: tuple[float, float, float] | None = None

    def observe(self, tokens: int, pairs: float, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0.0:
            return
        x = (_SCALE[0], tokens * _SCALE[1], pairs * _SCALE[2])
        d = self.decay
        for i in range(3):
            self._xty[i] = self._xty[i] * d + x[i] * seconds
            row = self._xtx[i]
            for j in range(3):
                row[j] = row[j] * d + x[i] * x[j]
        self.num_observations += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a seconds, b seconds per token, c seconds per pair), or None until enough steps were seen."""
        if self.num_observations < self.min_observations:
            return None
        if self._coef is None:
            a, b, c = _solve(self._xtx, self._xty, self.ridge)
            # Time cannot fall with more work: a negative slope is noise, not physics.
            self._coef = (max(a, 0.0) * _SCALE[0], max(b, 0.0) * _SCALE[1], max(c, 0.0) * _SCALE[2])
        return self._coef

    def predict(self, tokens: int, pairs: float) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        return a + b * tokens + c * pairs


def _solve(xtx: list[list[float]], xty: list[float], ridge: float) -> list[float]:
    """(XtX + ridge*I) w = Xty by Gaussian elimination with partial pivoting (3x3)."""
    m = [[xtx[i][j] + (ridge if i == j else 0.0) for j in range(3)] + [xty[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return [0.0, 0.0, 0.0]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for k in range(col, 4):
                m[r][k] -= f * m[col][k]
    w = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        w[i] = (m[i][3] - sum(m[i][k] * w[k] for k in range(i + 1, 3))) / m[i][i]
    return w
