"""When sequence slots free (scheduler.slot_release): the expected releases an engine
reports, from its running requests' max_tokens left, their ages and its measured stop
curve."""

from __future__ import annotations

import math
import random

import pytest

from engine.stop_hazard import NUM_BUCKETS, StopCurve, bucket_start
from scheduler.slot_release import (
    merge_releases,
    nth_release_ms,
    release_steps,
    release_times_ms,
)

FLAT = StopCurve([1 / 200] * NUM_BUCKETS)


def _order_statistics(draw_ends, num_draws: int = 20_000) -> list[float]:
    """The mean k-th smallest of the ends draw_ends() returns, over many draws."""
    draws = [sorted(draw_ends()) for _ in range(num_draws)]
    return [sum(d[k] for d in draws) / num_draws for k in range(len(draws[0]))]


def _geometric_end(rng: random.Random, hazard: float, bound: int) -> int:
    """Tokens until a request stopping with `hazard` per token ends, at most `bound`."""
    end = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - hazard))
    return min(end, bound)


def test_requests_that_cannot_stop_early_free_their_slots_at_their_max_tokens() -> None:
    running = [(300, 5, False), (20, 7, False), (90, 0, False)]
    assert release_steps(running, FLAT) == [20.0, 90.0, 300.0]
    # Unmeasured: every request is taken to run to its max_tokens (a bound).
    may_stop = [(300, 5, True), (20, 7, True)]
    assert release_steps(may_stop, None) == [20.0, 300.0]
    assert release_steps(may_stop, StopCurve()) == [20.0, 300.0]


def test_requests_that_may_stop_early_free_slots_at_the_expected_order_statistics() -> None:
    # Chats of mixed max_tokens stopping at 1 in 200 tokens, beside one that cannot stop
    # early: the expected k-th release against the mean over many draws.
    rng = random.Random(3)
    bounds = [400, 150, 900, 900, 60, 2_000]
    running = [(b, 0, True) for b in bounds] + [(120, 0, False)]
    means = _order_statistics(lambda: [_geometric_end(rng, 1 / 200, b) for b in bounds] + [120])
    predicted = release_steps(running, FLAT)
    assert len(predicted) == len(means)
    for k, (got, mean) in enumerate(zip(predicted, means, strict=True)):
        assert got == pytest.approx(mean, rel=0.12), k
    assert predicted == sorted(predicted)


def test_the_quantile_is_the_step_by_which_a_slot_has_freed_that_often() -> None:
    rng = random.Random(11)
    bounds = [400, 150, 900, 900, 60, 2_000]
    running = [(b, 0, True) for b in bounds]
    draws = [sorted(_geometric_end(rng, 1 / 200, b) for b in bounds) for _ in range(20_000)]
    q90 = release_steps(running, FLAT, quantile=0.9)
    expected = release_steps(running, FLAT)
    shares = []
    for k, (late, mean) in enumerate(zip(q90, expected, strict=True)):
        shares.append(sum(d[k] > late for d in draws) / len(draws))
        assert shares[-1] <= 0.16, k
        assert late >= mean
    # Later in 10% of draws, less where a bound ends the wait for sure (the first slot
    # frees by step 60 whatever happens).
    assert q90[0] == 60.0
    assert 0.05 < sum(shares) / len(shares) < 0.12
    assert q90 == sorted(q90)
    # Requests that cannot stop early: a quantile of a sure end is that end.
    assert release_steps([(30, 0, False), (10, 0, False)], FLAT, quantile=0.9) == [10.0, 30.0]


def test_a_long_running_request_on_a_heavy_tail_frees_its_slot_later() -> None:
    # Hazards falling with age (a heavy tail): a chat 3,000 tokens in is expected to
    # run on far longer than a fresh one, as the real order statistics say.
    hazards = [1 / (60 * (b + 1) ** 1.5) for b in range(NUM_BUCKETS)]
    curve = StopCurve(hazards)
    fresh = release_steps([(8_000, 0, True)], curve)
    old = release_steps([(8_000, 3_000, True)], curve)
    assert old[0] > 2 * fresh[0]
    # One request's release is its expected tokens left.
    assert fresh[0] == pytest.approx(curve.expected_tokens_left(0, 8_000), rel=0.1)
    assert old[0] == pytest.approx(curve.expected_tokens_left(3_000, 8_000), rel=0.1)
    # Against draws from the curve itself, for four requests of different ages.
    rng = random.Random(5)
    ages = [0, 40, 700, 3_000]

    def end(age: int, bound: int = 8_000) -> int:
        made = 0
        while made < bound:
            b = min(NUM_BUCKETS - 1, max(0, (age + made).bit_length() - 4))
            # Jump to the stop or the bucket's end at the bucket's hazard.
            edge = bucket_start(b + 1) if b + 1 < NUM_BUCKETS else math.inf
            run = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - hazards[b]))
            if age + made + run <= edge:
                return min(made + run, bound)
            made = int(edge) - age
        return bound

    means = _order_statistics(lambda: [end(a) for a in ages], num_draws=6_000)
    predicted = release_steps([(8_000, a, True) for a in ages], curve)
    for k, (got, mean) in enumerate(zip(predicted, means, strict=True)):
        assert got == pytest.approx(mean, rel=0.15), k


def test_release_times_at_the_step_time_and_merged_over_a_fleet() -> None:
    # 4 running at 200 tokens/s: a step takes 20 ms.
    assert release_times_ms([(3, 0, False), (1, 0, False)], None, 4, 200.0) == [20.0, 60.0]
    assert release_times_ms([(3, 0, False)], None, 4, 0.0) == []  # no measured rate
    assert release_steps([(5, 0, False)] * 100, limit=3) == [5.0, 5.0, 5.0]
    assert len(release_steps([(900, 0, True)] * 100, FLAT, limit=3)) == 3
    assert merge_releases([[20.0, 60.0], [10.0, 70.0]], limit=3) == (10.0, 20.0, 60.0)


def test_the_nth_release() -> None:
    releases = (100.0, 300.0)
    assert [nth_release_ms(releases, k) for k in (0, 1)] == [100.0, 300.0]
    assert nth_release_ms(releases, 3) == pytest.approx(300.0 * 4 / 2)  # at their pace
    assert nth_release_ms((), 5) == 0.0
    assert nth_release_ms(releases, -1) == 0.0
