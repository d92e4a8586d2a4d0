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
Workers may report a quantile q instead (TIERGATE_SLOT_WAIT_QUANTILE): the step by
which the k-th slot has freed with probability q, where P(fewer than k ended) falls
below 1 - q. When requests may stop early the wait scatters widely: the expected k-th
release came after the real one in 38-44% of cases, the 90% quantile in 6-8%.
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

from engine.stop_hazard import FIRST_EDGE_BITS, StopCurve

# Releases reported per worker, and kept for the fleet: a request further back than this
# in the line for a slot is predicted by extrapolation (nth_release_ms).
MAX_RELEASES = 64
# Successive grid points in decode steps: the integral's resolution, about 15% of t.
_GRID_FACTOR = 1.3
# The smallest bounds the grid steps exactly (the first releases matter most).
_EXACT_STEPS = 16
_SQRT2 = math.sqrt(2.0)


def release_steps(
    running: Iterable[tuple[int, int, bool]],
    curve: StopCurve | None = None,
    limit: int = MAX_RELEASES,
    quantile: float | None = None,
) -> list[float]:
    """Decode steps until each of the first `limit` slots frees, ascending: expected, or
    with `quantile` q the step by which it has freed with probability q.

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
    # By the num-th smallest bound at least num requests have ended: nothing asked of
    # later times. Each of the first bounds is a step in the probabilities: the grid
    # takes the step just before and at it.
    every_bound = sorted(bounds + [bound for bound, _ in early])
    top = every_bound[num - 1]
    grid = _grid(top, every_bound[: min(num, _EXACT_STEPS)])
    tables = curve.survival_tables()
    starts = [curve.log_survival(age) for _, age in early]
    # The mean integrates P(T(k) > t) = P(fewer than k ended by t); the q-quantile is
    # where that probability falls to 1 - q.
    result = [0.0] * num if quantile is None else [float(top)] * num
    found = [False] * num
    previous_t = 0.0
    previous_p: list[float] | None = None
    for t in grid:
        p = _fewer_than(num, t, bounds, early, starts, tables)
        if previous_p is not None:
            if quantile is None:
                half_step = (t - previous_t) / 2
                for k in range(num):
                    result[k] += half_step * (p[k] + previous_p[k])
            else:
                _crossings(result, found, 1.0 - quantile, previous_t, previous_p, t, p)
        if p[-1] < 1e-9 or (quantile is not None and found[-1]):
            break
        previous_t, previous_p = t, p
    for k in range(1, num):  # the approximation may dip: releases come in order
        result[k] = max(result[k], result[k - 1])
    return result


def _grid(top: int, steps: list[int]) -> list[float]:
    """0, then a geometric grid of decode steps up to `top`, with a point just before
    and at each of `steps` (bounds where requests surely end)."""
    points = {0.0, float(top)}
    t = 1.0
    while t < top:
        points.add(t)
        t *= _GRID_FACTOR
    for step in steps:
        points.update((max(0.0, step - 1.0), float(step)))
    return sorted(p for p in points if p <= top)


def _crossings(
    result: list[float],
    found: list[bool],
    level: float,
    t0: float,
    p0: list[float],
    t1: float,
    p1: list[float],
) -> None:
    """Where each P(T(k) > t) not yet below `level` falls below it between t0 and t1:
    linearly between the two, or at t1 across one step (a bound's sure end)."""
    for k, (a, b) in enumerate(zip(p0, p1, strict=True)):
        if found[k] or b > level:
            continue
        found[k] = True
        if a <= level or a == b or t1 - t0 <= 1.0:
            result[k] = t1
        else:
            result[k] = t0 + (t1 - t0) * (a - level) / (a - b)


def _fewer_than(
    num: int,
    t: float,
    bounds: list[int],
    early: list[tuple[int, int]],
    starts: list[float],
    tables: tuple[list[int], list[float], list[float]],
) -> list[float]:
    """P(fewer than k requests ended by decode step t), for k = 1..num."""
    num_ended = float(bisect.bisect_right(bounds, t))  # at their bound by t
    variance = 0.0
    log_none = 0.0 if num_ended == 0 else -math.inf  # log P(none ended)
    steps = int(t)
    # StopCurve.log_survival, inlined: this loop runs per request and grid point.
    bucket_starts, log_at_start, log_keep = tables
    last = len(bucket_starts) - 1
    for (bound, age), start in zip(early, starts, strict=True):
        if t >= bound:
            num_ended += 1.0
            log_none = -math.inf
            continue
        at = age + steps
        b = at.bit_length() - FIRST_EDGE_BITS
        b = 0 if b < 0 else (last if b > last else b)
        log_alive = log_at_start[b] + (at - bucket_starts[b]) * log_keep[b] - start
        alive = math.exp(log_alive)
        num_ended += 1.0 - alive
        variance += alive * (1.0 - alive)
        log_none += log_alive
    p = [math.exp(log_none)]
    sd = math.sqrt(variance)
    # Phi((k - 0.5 - mean) / sd): 0 or 1 to double precision beyond 9 sd, so only the
    # ranks within 9 sd of the mean need the function (this runs per grid point).
    low = num_ended + 0.5 - 9.0 * sd
    high = num_ended + 0.5 + 9.0 * sd
    scale = 1.0 / (sd * _SQRT2) if sd >= 1e-9 else 0.0
    for k in range(2, num + 1):
        if k <= low:
            p.append(0.0)
        elif k >= high:
            p.append(1.0)
        else:
            p.append(0.5 * math.erfc((num_ended + 0.5 - k) * scale))
    return p


def release_times_ms(
    running: Iterable[tuple[int, int, bool]],
    curve: StopCurve | None,
    num_running: int,
    decode_tokens_per_s: float,
    limit: int = MAX_RELEASES,
    quantile: float | None = None,
) -> list[float]:
    """release_steps at the engine's step time (a decode step makes one token for each
    of the `num_running` requests at `decode_tokens_per_s`); [] when it has no rate."""
    if num_running <= 0 or decode_tokens_per_s <= 0:
        return []
    step_ms = 1000.0 * num_running / decode_tokens_per_s
    return [steps * step_ms for steps in release_steps(running, curve, limit, quantile)]


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
