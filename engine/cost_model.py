"""Online model of how long one engine step takes: step_s = a + b * tokens (+ c * seqs).

The engine feeds it every measured step; the step scheduler asks it how many tokens a
step may batch and still keep the tightest running TPOT SLO, and workers publish the
rates it implies as their capacity. Older steps fade out (exponential forgetting) so the
fit follows the machine as load, clocks and sequence lengths change.

Pure Python, a least-squares fit of two or three coefficients.
"""

from __future__ import annotations

import math


class StepCostModel:
    """Online least-squares fit of step time against batched tokens (and sequences)."""

    def __init__(
        self, *, min_samples: int = 8, decay: float = 0.98, use_num_seqs: bool = False
    ) -> None:
        """`decay` weighs each older step by that factor; `use_num_seqs` adds a per-
        sequence term, which is only identifiable once steps mix prefill and decode."""
        if min_samples < 2:
            raise ValueError("min_samples must be at least 2")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.min_samples = min_samples
        self.decay = decay
        self.use_num_seqs = use_num_seqs
        k = 3 if use_num_seqs else 2
        self._xtx = [[0.0] * k for _ in range(k)]  # decayed sum of x x^T
        self._xty = [0.0] * k  # decayed sum of x * step_s
        self._coef: list[float] | None = None
        self._num_samples = 0
        self._num_token_counts: set[int] = set()
        # Decayed totals for the measured throughput.
        self._tokens = 0.0
        self._seconds = 0.0

    def _features(self, num_batched_tokens: int, num_seqs: int) -> list[float]:
        x = [1.0, float(num_batched_tokens)]
        if self.use_num_seqs:
            x.append(float(num_seqs))
        return x

    def observe(self, num_batched_tokens: int, num_seqs: int, step_time_s: float) -> None:
        """Record one executed step. Non-finite or negative times are ignored."""
        if num_batched_tokens <= 0 or not math.isfinite(step_time_s) or step_time_s < 0:
            return
        x = self._features(num_batched_tokens, num_seqs)
        decay = self.decay
        if len(x) == 2:
            # The loop below for two features, unrolled (an engine observes every step).
            x0, x1 = x
            row0, row1, xty = self._xtx[0], self._xtx[1], self._xty
            row0[0] = decay * row0[0] + x0 * x0
            row0[1] = decay * row0[1] + x0 * x1
            xty[0] = decay * xty[0] + x0 * step_time_s
            row1[0] = decay * row1[0] + x1 * x0
            row1[1] = decay * row1[1] + x1 * x1
            xty[1] = decay * xty[1] + x1 * step_time_s
        else:
            for i, xi in enumerate(x):
                row = self._xtx[i]
                for j, xj in enumerate(x):
                    row[j] = decay * row[j] + xi * xj
                self._xty[i] = decay * self._xty[i] + xi * step_time_s
        self._num_samples += 1
        if len(self._num_token_counts) < 2:
            self._num_token_counts.add(num_batched_tokens)
        self._tokens = self.decay * self._tokens + num_batched_tokens
        self._seconds = self.decay * self._seconds + step_time_s
        self._coef = None

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def is_ready(self) -> bool:
        """Enough steps, of at least two sizes, to trust the slope."""
        return self._num_samples >= self.min_samples and len(self._num_token_counts) >= 2

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a, b) or (a, b, c), in seconds, seconds per token and seconds per sequence."""
        if self._coef is None:
            self._coef = _solve_ridge(self._xtx, self._xty)
        return tuple(self._coef)

    def predict(self, num_batched_tokens: int, num_seqs: int) -> float:
        """Predicted seconds of a step batching this many tokens over this many sequences."""
        coef = self.coefficients
        x = self._features(num_batched_tokens, num_seqs)
        return max(0.0, sum(c * xi for c, xi in zip(coef, x, strict=True)))

    def max_batched_tokens(self, step_time_s: float, num_seqs: int) -> int | None:
        """Most tokens a step of `num_seqs` sequences may batch within `step_time_s`.

        None when the fit sets no limit (not ready, or time does not grow with tokens).
        """
        if not self.is_ready:
            return None
        coef = self.coefficients
        a, b = coef[0], coef[1]
        if b <= 0:
            return None
        fixed = a + (coef[2] * num_seqs if self.use_num_seqs else 0.0)
        return max(0, math.floor((step_time_s - fixed) / b))

    def prefill_tokens_per_s(self) -> float | None:
        """Marginal prompt tokens per second (1 / b); None until the fit is ready."""
        if not self.is_ready:
            return None
        b = self.coefficients[1]
        return 1.0 / b if b > 0 else None

    def decode_tokens_per_s(self, num_seqs: int) -> float | None:
        """Generated tokens per second of a pure decode step over `num_seqs` sequences."""
        if not self.is_ready or num_seqs <= 0:
            return None
        step_s = self.predict(num_seqs, num_seqs)
        return num_seqs / step_s if step_s > 0 else None

    def measured_tokens_per_s(self) -> float | None:
        """Recent batched tokens per second of wall time spent in steps."""
        return self._tokens / self._seconds if self._seconds > 0 else None


def _solve_ridge(xtx: list[list[float]], xty: list[float]) -> list[float]:
    """Solve (X^T X + ridge) coef = X^T y by Gaussian elimination with partial pivoting.

    A tiny ridge on the slopes (not the intercept) keeps the system solvable when every
    step had the same size, giving a flat fit instead of a division by zero.
    """
    if len(xty) == 2:
        return _solve_ridge_2(xtx, xty)
    return _solve_ridge_any(xtx, xty)


def _solve_ridge_2(xtx: list[list[float]], xty: list[float]) -> list[float]:
    """`_solve_ridge_any` for two coefficients written out: the same operations in the
    same order, so the same bits (a fit is solved again after every observed step)."""
    top = [xtx[0][0], xtx[0][1], xty[0]]
    low = [xtx[1][0], xtx[1][1], xty[1]]
    low[1] += 1e-9 * max(1.0, low[1])
    if abs(low[0]) > abs(top[0]):  # max() keeps the first row on a tie
        top, low = low, top
    if abs(top[0]) < 1e-300:
        return [0.0, 0.0]
    f = low[0] / top[0]
    low1 = low[1] - f * top[1]
    low2 = low[2] - f * top[2]
    if abs(low1) < 1e-300:
        return [0.0, 0.0]
    coef1 = (low2 - 0) / low1
    coef0 = (top[2] - (0 + top[1] * coef1)) / top[0]
    return [coef0, coef1]


def _solve_ridge_any(xtx: list[list[float]], xty: list[float]) -> list[float]:
    k = len(xty)
    m = [[*row, xty[i]] for i, row in enumerate(xtx)]
    for i in range(1, k):
        m[i][i] += 1e-9 * max(1.0, m[i][i])
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return [0.0] * k
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for c in range(col, k + 1):
                m[r][c] -= f * m[col][c]
    coef = [0.0] * k
    for i in reversed(range(k)):
        coef[i] = (m[i][k] - sum(m[i][j] * coef[j] for j in range(i + 1, k))) / m[i][i]
    return coef
