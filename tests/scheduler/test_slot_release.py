"""When sequence slots free (scheduler.slot_release): the expected releases an engine
reports, from its running requests' max_tokens left and its measured stop hazard."""

from __future__ import annotations

import random

import pytest

from scheduler.slot_release import (
    merge_releases,
    nth_release_ms,
    release_steps,
    release_times_ms,
)


def test_requests_that_cannot_stop_early_free_their_slots_at_their_max_tokens() -> None:
    running = [(300, True), (20, True), (90, True)]
    assert release_steps(running, stop_hazard=0.05) == [20.0, 90.0, 300.0]
    # Unmeasured hazard: every request is taken to run to its max_tokens (a bound).
    assert release_steps([(300, False), (20, False)], stop_hazard=0.0) == [20.0, 300.0]


def test_requests_that_may_stop_early_free_slots_sooner() -> None:
    # Four chats allowed 1,500 tokens each, stopping at 1 in 500 tokens: the first of
    # four geometric waits comes after 500 / 4 tokens, the next after 500 / 3 more.
    steps = release_steps([(1_500, False)] * 4, stop_hazard=1 / 500)
    assert steps == pytest.approx(
        [125.0, 125.0 + 500 / 3, 125.0 + 500 / 3 + 250, 1_041.67], rel=1e-4
    )
    # A bound reached first ends its request: no release comes later than its bound.
    steps = release_steps([(10, False), (1_500, False)], stop_hazard=1 / 500)
    assert steps[0] == 10.0
    assert steps[1] == pytest.approx(10.0 + 500.0)
    # Mixed with a request that can only run to its end.
    steps = release_steps([(50, True), (1_500, False)], stop_hazard=1 / 500)
    assert steps == [50.0, 500.0]


def test_the_walk_matches_a_monte_carlo_of_geometric_stops() -> None:
    # The expected k-th release of m requests stopping with a per-token hazard, bounded
    # by their max_tokens, against the mean over many draws.
    rng = random.Random(3)
    hazard, bounds = 1 / 200, [400, 150, 900, 900, 60, 2_000]
    running = [(b, False) for b in bounds]
    draws = []
    for _ in range(20_000):
        ends = []
        for bound in bounds:
            t = 1
            while t < bound and rng.random() >= hazard:
                t += 1
            ends.append(t)
        draws.append(sorted(ends))
    means = [sum(d[k] for d in draws) / len(draws) for k in range(len(bounds))]
    walked = release_steps(running, hazard)
    # A fluid approximation: within 25% of the simulated means at every rank.
    for k, (got, mean) in enumerate(zip(walked, means, strict=True)):
        assert got == pytest.approx(mean, rel=0.25), k


def test_release_times_at_the_step_time_and_merged_over_a_fleet() -> None:
    # 4 running at 200 tokens/s: a step takes 20 ms.
    assert release_times_ms([(3, True), (1, True)], 0.0, 4, 200.0) == [20.0, 60.0]
    assert release_times_ms([(3, True)], 0.0, 4, 0.0) == []  # no measured rate
    assert release_steps([(5, True)] * 100, 0.0, limit=3) == [5.0, 5.0, 5.0]
    assert merge_releases([[20.0, 60.0], [10.0, 70.0]], limit=3) == (10.0, 20.0, 60.0)


def test_the_nth_release() -> None:
    releases = (100.0, 300.0)
    assert [nth_release_ms(releases, k) for k in (0, 1)] == [100.0, 300.0]
    assert nth_release_ms(releases, 3) == pytest.approx(300.0 * 4 / 2)  # at their pace
    assert nth_release_ms((), 5) == 0.0
    assert nth_release_ms(releases, -1) == 0.0
