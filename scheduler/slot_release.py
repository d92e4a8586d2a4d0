"""When an engine's sequence slots free: the waits SLO admission predicts for a request
that finds every slot taken.

A running request ends at the latest after the tokens its max_tokens leaves it; one that
can stop earlier (end of sequence, a stop string or token) stops, per token, with the
probability its engine has measured over recent requests (`stop_hazard`, EngineStats).
The k-th slot to free is what the k-th request waiting for one waits for: under a burst
of priority requests, the second waits for the second release, not the first.

The expected release times are walked in decode steps: the next release is the soonest
of a request reaching its max_tokens and one of the m requests that may stop early
stopping (expected after 1 / (m x hazard) steps, as the first of m geometric waits);
then in milliseconds at the engine's step time. With no measured hazard only the
max_tokens bounds count: a wait that is sure not to be longer (one long generation per
slot that cannot stop early, `ignore_eos`, has exactly that wait). Counting the bounds
alone for chats that stop early, a helper's 8 chat clients with max_tokens 1,500 and a
mean of 590 got 30 of 74 priority requests refused, 12 of them when a slot freed within
450 ms.

Pure Python: the dispatcher publishes this from its engine's stats, the simulator from
its engines'.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

# Releases reported per worker, and kept for the fleet: a request further back than this
# in the line for a slot is predicted by extrapolation (nth_release_ms).
MAX_RELEASES = 64


def release_steps(
    running: Iterable[tuple[int, bool]], stop_hazard: float, limit: int = MAX_RELEASES
) -> list[float]:
    """Expected decode steps until each of the first `limit` slots frees, ascending.

    `running`: per running request, (tokens its max_tokens still allows, whether it can
    only end there: no way to stop early). `stop_hazard`: the measured probability that a
    request able to stop early stops at a given token (0: not measured, bounds only)."""
    exact: list[float] = []
    bounds: list[float] = []
    for left, is_exact in running:
        (exact if is_exact or stop_hazard <= 0 else bounds).append(float(max(left, 0)))
    exact.sort()
    bounds.sort()
    releases: list[float] = []
    i_exact = i_bound = 0
    num_early = len(bounds)  # requests that may still stop early
    now = 0.0
    # The expected next early stop, drawn again only when the number of requests that
    # may stop changes: stopping is memoryless, so another request's end moves nothing.
    at_stop = 1.0 / (num_early * stop_hazard) if num_early else float("inf")
    while len(releases) < limit and (i_exact < len(exact) or num_early > 0):
        at_exact = exact[i_exact] if i_exact < len(exact) else float("inf")
        at_bound = bounds[i_bound] if num_early > 0 else float("inf")
        now = max(now, min(at_exact, at_bound, at_stop))
        if at_exact <= min(at_bound, at_stop):
            i_exact += 1
        else:
            # A bound reached ends its own request; an early stop ends one we cannot
            # name: the one with the most tokens left is taken out, so the bounds left
            # stay ones that will surely end by then.
            num_early -= 1
            if at_bound <= at_stop:
                i_bound += 1
            else:
                bounds.pop()
            at_stop = now + 1.0 / (num_early * stop_hazard) if num_early else float("inf")
        releases.append(now)
    return releases


def release_times_ms(
    running: Iterable[tuple[int, bool]],
    stop_hazard: float,
    num_running: int,
    decode_tokens_per_s: float,
    limit: int = MAX_RELEASES,
) -> list[float]:
    """release_steps at the engine's step time (a decode step makes one token for each
    of the `num_running` requests at `decode_tokens_per_s`); [] when it has no rate."""
    if num_running <= 0 or decode_tokens_per_s <= 0:
        return []
    step_ms = 1000.0 * num_running / decode_tokens_per_s
    return [steps * step_ms for steps in release_steps(running, stop_hazard, limit)]


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
