"""Step-time noise: how much a real engine's steps vary around the roofline's prediction.

The roofline predicts a step's mean time; a real engine's steps scatter around it, and
not independently: on a host shared with the HTTP side, a garbage collection or other
work, slow steps come in stretches. Those stretches make the tails. On two CPU cores the
engine's 30-step stretches stayed within 1.7x of the prediction at P99, yet a request's
TPOT reached 4x its median at P99, because a stretch of slow steps lasts longer in time
and catches more arrivals. A deterministic step time cannot show that; the simulator's
P99 TTFT and TPOT came out 35-55% short of the real ones.

The model: each step's time is the prediction times a multiplier. The multipliers'
distribution is a table of quantiles (their mean is 1, so throughput stays the roofline's),
and their order follows a first-order autoregression of normal scores (a Gaussian
copula): `autocorr` near 1 gives long stretches, 0 independent steps. The autocorrelation
is fitted so that the mean over a typical request's decode steps varies as measured,
which is what TPOT sees, rather than to the next step's correlation alone.
"""

from __future__ import annotations

import itertools
import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean

# The probabilities of the quantile table: both tails finely, where P99s come from.
PROBABILITIES = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)
# The steps over which the fit matches how much the mean multiplier varies: about a
# request's decode steps, whose mean is its TPOT.
WINDOW_STEPS = 16
# Fewer measured steps than this tell no tail: the 0.1% quantiles need a thousand.
MIN_SAMPLES = 1000
# A multiplier beyond these bounds is no step-time variation but a broken measurement.
MIN_MULTIPLIER, MAX_MULTIPLIER = 1e-3, 1e3
MAX_AUTOCORR = 0.999

_NORMAL = NormalDist()
_SCORES = tuple(_NORMAL.inv_cdf(p) for p in PROBABILITIES)


class StepNoiseError(ValueError):
    """A quantile table or autocorrelation that cannot describe step times."""


@dataclass(frozen=True)
class StepNoise:
    """Multipliers of predicted step times: `quantiles` at PROBABILITIES, `autocorr` of
    consecutive steps' normal scores."""

    quantiles: tuple[float, ...]
    autocorr: float

    def __post_init__(self) -> None:
        q = self.quantiles
        if len(q) != len(PROBABILITIES):
            raise StepNoiseError(
                f"step noise needs {len(PROBABILITIES)} quantiles, at probabilities "
                f"{', '.join(map(str, PROBABILITIES))}"
            )
        for value in q:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StepNoiseError("step noise quantiles must be numbers")
            if not MIN_MULTIPLIER <= value <= MAX_MULTIPLIER:
                raise StepNoiseError(
                    f"step noise quantiles must be within [{MIN_MULTIPLIER}, {MAX_MULTIPLIER}]"
                )
        if any(b < a for a, b in itertools.pairwise(q)):
            raise StepNoiseError("step noise quantiles must not decrease")
        a = self.autocorr
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= MAX_AUTOCORR:
            raise StepNoiseError(f"step noise autocorr must be a number in [0, {MAX_AUTOCORR}]")
        object.__setattr__(self, "quantiles", tuple(float(v) for v in q))
        object.__setattr__(self, "autocorr", float(a))

    def to_dict(self) -> dict[str, object]:
        return {"quantiles": list(self.quantiles), "autocorr": self.autocorr}

    def multiplier(self, score: float) -> float:
        """The multiplier at a normal score: log-linear between the table's points,
        the end points beyond them (so no step is unboundedly long)."""
        i = bisect_right(_SCORES, score)
        q = self.quantiles
        if i == 0:
            return q[0]
        if i == len(q):
            return q[-1]
        z0, z1 = _SCORES[i - 1], _SCORES[i]
        f = (score - z0) / (z1 - z0)
        return math.exp(math.log(q[i - 1]) * (1 - f) + math.log(q[i]) * f)

    def mean(self) -> float:
        """The multipliers' mean under the interpolated table (numerically)."""
        n = 4000
        lo, hi = -6.0, 6.0
        step = (hi - lo) / n
        total = 0.0
        for k in range(n + 1):
            z = lo + k * step
            weight = 0.5 if k in (0, n) else 1.0
            total += weight * self.multiplier(z) * _NORMAL.pdf(z)
        return total * step


class NoiseStream:
    """The multipliers of one engine's steps, by step index: the same index gives the
    same multiplier however the steps are taken (one at a time or a fast-forwarded run),
    and the same seed the same sequence (every policy of a comparison sees the same
    machine)."""

    def __init__(self, noise: StepNoise, seed: str) -> None:
        self._noise = noise
        self._rng = random.Random(seed)
        self._innovation = math.sqrt(1.0 - noise.autocorr**2)
        self._score = self._rng.gauss(0.0, 1.0)
        self._first = 0  # step index of _values[0]
        self._values: list[float] = []

    def at(self, index: int) -> float:
        """The multiplier of step `index`; earlier indices than the last one forgotten
        (`forget_before`) may not be asked again."""
        offset = index - self._first
        values = self._values
        noise, rng, rho, innovation = self._noise, self._rng, self._noise.autocorr, self._innovation
        while len(values) <= offset:
            values.append(noise.multiplier(self._score))
            self._score = rho * self._score + innovation * rng.gauss(0.0, 1.0)
        return values[offset]

    def forget_before(self, index: int) -> None:
        """Drop multipliers of steps before `index` (taken), keeping memory bounded."""
        drop = index - self._first
        if drop > 0:
            del self._values[:drop]
            self._first = index


def fit_step_noise(ratios: Sequence[float]) -> StepNoise:
    """The noise of measured step times against their predictions, `ratios` (measured /
    predicted) in the order the steps ran."""
    if len(ratios) < MIN_SAMPLES:
        raise StepNoiseError(
            f"fitting step noise needs at least {MIN_SAMPLES} steps in the order they ran "
            f"(got {len(ratios)})"
        )
    if not all(math.isfinite(r) and r > 0 for r in ratios):
        raise StepNoiseError("step time ratios must be finite and > 0")
    ordered = sorted(ratios)
    n = len(ordered)

    def quantile(p: float) -> float:
        x = p * (n - 1)
        i = int(x)
        j = min(i + 1, n - 1)
        return ordered[i] + (ordered[j] - ordered[i]) * (x - i)

    table = [quantile(p) for p in PROBABILITIES]
    # Normalised to mean 1: the roofline is fitted to mean step times already.
    scale = StepNoise(tuple(_clamp(v) for v in table), 0.0).mean()
    quantiles = tuple(_clamp(v / scale) for v in table)
    # Normal scores of the ratios by rank, in step order.
    rank = {}
    for i, r in enumerate(ordered):
        rank.setdefault(r, i)
    scores = [_NORMAL.inv_cdf((rank[r] + 0.5) / n) for r in ratios]
    return StepNoise(quantiles, _fit_autocorr(scores))


def _clamp(value: float) -> float:
    return min(MAX_MULTIPLIER, max(MIN_MULTIPLIER, value))


def _fit_autocorr(scores: Sequence[float]) -> float:
    """The AR(1) coefficient under which the mean of WINDOW_STEPS consecutive scores
    varies as much as the measured windows' means do (their scores' variance is ~1)."""
    w = WINDOW_STEPS
    means = [fmean(scores[i : i + w]) for i in range(0, len(scores) - w + 1, w)]
    if len(means) < 2:
        return 0.0
    mu = fmean(means)
    measured = sum((m - mu) ** 2 for m in means) / (len(means) - 1)

    def window_variance(rho: float) -> float:
        return (1 + 2 * sum((1 - k / w) * rho**k for k in range(1, w))) / w

    if measured <= window_variance(0.0):
        return 0.0
    lo, hi = 0.0, MAX_AUTOCORR
    if measured >= window_variance(hi):
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if window_variance(mid) < measured:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)
