"""StepCostModel: predicts a step's forward time from its shape, learned online from the worker's timings.

    seconds ~= a + b * tokens + c * attention_pairs + e * encoder_tokens

`tokens` is the step's scheduled token count (what the matmuls scale with) and `attention_pairs` the number of
(query, key) pairs its attention computes: a chunk of k new tokens ending at context length L adds
k * (L - (k - 1) / 2), a decode at context L adds L. `encoder_tokens` are the placeholder tokens of the images the
step encodes (vision-language models: an image's whole encoder runs in the step whose chunk first reaches it, and
on a CPU it can cost more than the chunk's own tokens). The weights are an exponentially weighted least-squares
fit (recent steps count most, so the model follows load, thermal and thread changes) with a small ridge term that
keeps it solvable while every step looks alike (steady decoding; no image seen yet: e stays 0). Pure Python:
four normal equations.
"""

from __future__ import annotations

# Features are scaled so the normal equations are well conditioned: tokens in thousands, pairs in millions.
_SCALE = (1.0, 1e-3, 1e-6, 1e-3)
_N = len(_SCALE)


def attention_pairs(num_new: int, context_end: int) -> float:
    """(query, key) pairs of a causal chunk of num_new tokens whose last one sits at context_end - 1."""
    return num_new * (context_end - (num_new - 1) / 2)


class StepCostModel:
    def __init__(self, decay: float = 0.998, min_observations: int = 8, ridge: float = 1e-5) -> None:
        self.decay = decay                    # weight of an observation falls by this per later step (memory ~500 steps)
        self.min_observations = min_observations
        self.ridge = ridge
        self.num_observations = 0
        self._xtx = [[0.0] * _N for _ in range(_N)]
        self._xty = [0.0] * _N
        self._coef: tuple[float, float, float, float] | None = None

    def observe(self, tokens: int, pairs: float, seconds: float, encoder_tokens: int = 0) -> None:
        if tokens <= 0 or not seconds > 0.0:
            return
        x = (_SCALE[0], tokens * _SCALE[1], pairs * _SCALE[2], encoder_tokens * _SCALE[3])
        d = self.decay
        for i in range(_N):
            self._xty[i] = self._xty[i] * d + x[i] * seconds
            row = self._xtx[i]
            for j in range(_N):
                row[j] = row[j] * d + x[i] * x[j]
        self.num_observations += 1
        self._coef = None

    def _fit(self) -> tuple[float, float, float, float] | None:
        if self.num_observations < self.min_observations:
            return None
        if self._coef is None:
            w = _solve(self._xtx, self._xty, self.ridge)
            # Time cannot fall with more work: a negative slope is noise, not physics.
            self._coef = tuple(max(wi, 0.0) * s for wi, s in zip(w, _SCALE))
        return self._coef

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a seconds, b seconds per token, c seconds per pair), or None until enough steps were seen."""
        coef = self._fit()
        return None if coef is None else coef[:3]

    def encoder_token_seconds(self) -> float:
        """e: seconds per encoder (image placeholder) token; 0.0 until fitted or while no image was encoded."""
        coef = self._fit()
        return 0.0 if coef is None else coef[3]

    def predict(self, tokens: int, pairs: float, encoder_tokens: int = 0) -> float | None:
        coef = self._fit()
        if coef is None:
            return None
        a, b, c, e = coef
        return a + b * tokens + c * pairs + e * encoder_tokens


def _solve(xtx: list[list[float]], xty: list[float], ridge: float) -> list[float]:
    """(XtX + ridge*I) w = Xty by Gaussian elimination with partial pivoting."""
    n = len(xty)
    m = [[xtx[i][j] + (ridge if i == j else 0.0) for j in range(n)] + [xty[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return [0.0] * n
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    w = [0.0] * n
    for i in reversed(range(n)):
        w[i] = (m[i][n] - sum(m[i][k] * w[k] for k in range(i + 1, n))) / m[i][i]
    return w
