"""When an engine's sequence slots free: the waits SLO admission predicts for a request
that finds every slot taken.

A running request ends at the latest after the tokens its max_tokens leaves it; one that
can stop earlier (end of sequence, a stop string or token) stops at each token with the
probability its engine measured, over recent requests, for requests as far into their
output (engine.stop_hazard: a chat that has already run long on a heavy-tailed workload
stops less readily than a fresh one). The k-th slot to free is what the k-th request
waiting for one waits for: under a burst of priority requests, the second waits for the
second release, not the first.

The expected k-th release is E[T(k)] = the integral over t of P(fewer than k requests
ended by step t), summed on a geometric grid of decode steps, with the number ended by t
a sum of independent Bernoulli variables: exact for the first release (all survive),
normal with a continuity correction for the others. Against the mean real order
statistics of 8 slots of lognormal output lengths (sigma 0.3 to 1.0) and geometric ones,
it misses by 4-9% on average over the ranks, 18% at worst, where one hazard for every age
missed by 4-57% on average and 146% at worst (`benchmarks/slot_release_accuracy.py`).
Then in milliseconds at the engine's step time. With no measured hazard only the
max_tokens bounds count: a wait that is sure not to be longer (one long generation per slot that
cannot stop early, `ignore_eos`, has exactly that wait).

Pure Python: the dispatcher publishes this from its engine's stats, the simulator from
its engines'.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable
from statistics import NormalDist

from engine.stop_hazard import StopCurve

# Releases reported per worker, and kept for the fleet: a request further back than this
# in the line for a slot is predicted by extrapolation (nth_release_ms).
MAX_RELEASES = 64
# Successive grid points in decode steps: the integral's resolution, about 15% of t.
_GRID_FACTOR = 1.3
_normal_cdf = NormalDist().cdf


def release_steps(
    running: Iterable[tuple[int, int, bool]],
    curve: StopCurve | None = None,
    limit: int = MAX_RELEASES,
) -> list[float]:
    """Expected decode steps until each of the first `limit` slots frees, ascending.

    `running`: per running request, (tokens its max_tokens still allows, tokens it has
    made, whether it can stop before its max_tokens). `curve`: the engine's measured stop
    hazards (None or unmeasured: every request runs to its bound)."""
    measured = curve is not None and curve.is_measured
    bounds: list[int] = []  # requests sure to run to their max_tokens
    early: list[tuple[int, int]] = []  # (bound, age) of those that may stop before
    for left, age, may_stop in running:
        bound = max(left, 0)
        if measured and may_stop and bound > 0:
            early.append((bound, age))
        else:
            bounds.append(bound)
    bounds.sort()
    if not early:
        return [float(b) for b in bounds[:limit]]
    assert curve is not None
    num = min(limit, len(bounds) + len(early))
    top = max(bound for bound, _ in early)
    if bounds:
        top = max(top, bounds[-1])
    log_survival = curve.log_survival
    starts = [log_survival(age) for _, age in early]
    expected = [0.0] * num
    previous_t = 0.0
    previous_p: list[float] | None = None
    t = 0.0
    while True:
        p = _fewer_than(num, t, bounds, early, starts, log_survival)
        if previous_p is not None:
            half_step = (t - previous_t) / 2
            for k in range(num):
                expected[k] += half_step * (p[k] + previous_p[k])
        if t >= top or p[-1] < 1e-9:
            break
        previous_t, previous_p = t, p
        t = min(top, max(1.0, t * _GRID_FACTOR))
    for k in range(1, num):  # the approximation may dip: releases come in order
        expected[k] = max(expected[k], expected[k - 1])
    return expected


def _fewer_than(
    num: int,
    t: float,
    bounds: list[int],
    early: list[tuple[int, int]],
    starts: list[float],
    log_survival,
) -> list[float]:
    """P(fewer than k requests ended by decode step t), for k = 1..num."""
    num_ended = float(bisect.bisect_right(bounds, t))  # at their bound by t
    variance = 0.0
    log_none = 0.0 if num_ended == 0 else -math.inf  # log P(none ended)
    steps = int(t)
    for (bound, age), start in zip(early, starts, strict=True):
        if t >= bound:
            num_ended += 1.0
            log_none = -math.inf
            continue
        log_alive = log_survival(age + steps) - start
        alive = math.exp(log_alive)
        num_ended += 1.0 - alive
        variance += alive * (1.0 - alive)
        log_none += log_alive
    p = [math.exp(log_none)]
    sd = math.sqrt(variance)
    for k in range(2, num + 1):
        if sd < 1e-9:
            p.append(1.0 if num_ended < k - 0.5 else 0.0)
        else:
            p.append(_normal_cdf((k - 0.5 - num_ended) / sd))
    return p


def release_times_ms(
    running: Iterable[tuple[int, int, bool]],
    curve: StopCurve | None,
    num_running: int,
    decode_tokens_per_s: float,
    limit: int = MAX_RELEASES,
) -> list[float]:
    """release_steps at the engine's step time (a decode step makes one token for each
    of the `num_running` requests at `decode_tokens_per_s`); [] when it has no rate."""
    if num_running <= 0 or decode_tokens_per_s <= 0:
        return []
    step_ms = 1000.0 * num_running / decode_tokens_per_s
    return [steps * step_ms for steps in release_steps(running, curve, limit)]


def merge_releases(per_worker: Iterable[Iterable[float]], limit: int = MAX_RELEASES) -> tuple:
    """The fleet's first `limit` slot releases, ascending, from each worker's."""
    return tuple(heapq.nsmallest(limit, (ms for worker in per_worker for ms in worker)))


def nth_release_ms(releases: tuple[float, ...], index: int) -> float:
    """The wait for release number `index` (0 is the first). Past the reported ones it
    grows at their average pace; with none reported (no request running) there is
    nothing to wait for."""
    if index < 0 or not releases:
        return 0.0
    if index < len(releases):
        return releases[index]
    return releases[-1] * (index + 1) / len(releases)
