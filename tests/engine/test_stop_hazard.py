"""The engine's measured stop hazard: how often a request able to stop early stops, per
generated token and by age, which workers publish so admission can tell when slots free
and how much of their max_tokens running requests will use."""

from __future__ import annotations

import math
import random

import pytest

from engine import LLM, SamplingParams
from engine.stop_hazard import (
    HALF_LIFE_TOKENS,
    MIN_TOKENS,
    NUM_BUCKETS,
    StopCurve,
    StopHazard,
    age_bucket,
    bucket_start,
    count_ages,
    new_step_counts,
)

PROMPT = [17, 240, 33, 501, 12, 9]


def _step(bucket: int, num_tokens: int, num_stops: int) -> tuple[list[int], list[int]]:
    tokens, stops = new_step_counts(), new_step_counts()
    tokens[bucket], stops[bucket] = num_tokens, num_stops
    return tokens, stops


def _learn(hazard: StopHazard, length: int) -> None:
    """One request that stopped after `length` tokens, as the engine's steps record it."""
    tokens, stops = new_step_counts(), new_step_counts()
    count_ages(tokens, 0, length)
    stops[age_bucket(length - 1)] += 1
    hazard.record(tokens, stops)


def test_age_buckets_double() -> None:
    assert [age_bucket(a) for a in (0, 15, 16, 31, 32, 1_000)] == [0, 0, 1, 1, 2, 6]
    assert age_bucket(10**9) == NUM_BUCKETS - 1
    assert [bucket_start(b) for b in range(4)] == [0, 16, 32, 64]
    # Many steps' tokens at once, as one at a time.
    at_once, one_by_one = new_step_counts(), new_step_counts()
    count_ages(at_once, 10, 100_000)
    for age in range(10, 100_010):
        one_by_one[age_bucket(age)] += 1
    assert at_once == one_by_one


def test_stops_per_token_weighted_towards_recent_requests() -> None:
    hazard = StopHazard()
    hazard.record(*_step(0, MIN_TOKENS - 1, 10))
    assert hazard.per_token == 0.0  # too little seen to say
    assert not hazard.curve.is_measured
    hazard.record(*_step(3, 1, 0))
    assert hazard.per_token == pytest.approx(10 / MIN_TOKENS)
    assert hazard.curve.is_measured
    # Long after, only what came since counts: the old stops have decayed away.
    for _ in range(20):
        hazard.record(*_step(0, HALF_LIFE_TOKENS, 0))
    assert hazard.per_token < 1e-5
    hazard.record(new_step_counts(), new_step_counts())  # a step of nothing


def test_a_flat_curve_is_a_geometric_length() -> None:
    curve = StopCurve([1 / 200] * NUM_BUCKETS)
    assert curve.expected_tokens_left(0, 1_500) == pytest.approx(200 * (1 - (1 - 1 / 200) ** 1_500))
    # Memoryless: where a request is changes nothing.
    assert curve.expected_tokens_left(5_000, 1_500) == pytest.approx(
        curve.expected_tokens_left(0, 1_500)
    )
    assert curve.expected_tokens_left(0, 3) == pytest.approx(2.985, abs=1e-3)  # bound binds
    assert curve.expected_tokens_left(0, 0) == 0.0
    assert StopCurve().expected_tokens_left(7, 1_500) == 1_500  # unmeasured: all it may
    assert StopCurve([1.0] * NUM_BUCKETS).expected_tokens_left(0, 10) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="all above 0"):
        StopCurve([0.01, 0.0] + [0.01] * (NUM_BUCKETS - 2))


def test_a_heavy_tail_is_learned_by_age() -> None:
    # Lognormal lengths (median 150, sigma 1.2): most stop within a few hundred tokens,
    # a few run for thousands. The curve says so: past its peak the hazard falls, an old
    # request expects many more tokens than a new one, and the expectations match the
    # lengths' own.
    rng = random.Random(7)
    lengths = [max(1, int(rng.lognormvariate(math.log(150), 1.2))) for _ in range(3_000)]
    hazard = StopHazard()
    for length in lengths:
        _learn(hazard, length)
    curve = hazard.curve
    assert curve.hazards[age_bucket(1_500)] < max(curve.hazards) / 2

    def residual(age: int, bound: int) -> float:
        alive = [min(n, age + bound) - age for n in lengths[-1_500:] if n > age]
        return sum(alive) / len(alive)

    for age in (0, 100, 300):
        assert curve.expected_tokens_left(age, 4_000) == pytest.approx(
            residual(age, 4_000), rel=0.15
        ), age
    assert curve.expected_tokens_left(1_500, 4_000) > 2 * curve.expected_tokens_left(0, 4_000)


def test_the_engine_measures_early_stops_and_ignores_requests_that_cannot_stop() -> None:
    llm = LLM("tiny-random", device="cpu", max_num_seqs=8, max_model_len=256)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].token_ids
    # Requests that can only end at max_tokens teach nothing about stopping.
    llm.generate([PROMPT] * 10, greedy)
    assert llm.engine.stats().stop_hazard == 0.0
    assert not llm.engine.stats().stop_curve.is_measured
    # A stop token first made as token stop_at + 1: each request stops there.
    stop_at = next(i for i in range(3, 40) if full[i] not in full[:i])
    stopping = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(full[stop_at],))
    llm.generate([PROMPT] * (2 * MIN_TOKENS // (stop_at + 1) + 1), stopping)
    stats = llm.engine.stats()
    assert stats.stop_hazard == pytest.approx(1 / (stop_at + 1), rel=0.05)
    # Every stop came at age stop_at: its bucket holds them, and the curve knows a
    # request past it (none seen) only from the overall hazard.
    curve = stats.stop_curve
    assert curve.hazards[age_bucket(stop_at)] == max(curve.hazards)
