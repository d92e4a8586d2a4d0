"""Step cost model: online linear fit of step time, token limits and rates."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost_model import StepCostModel


def feed(model: StepCostModel, a: float, b: float, c: float = 0.0, *, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        num_seqs = rng.randint(1, 32)
        num_tokens = num_seqs + rng.choice([0, 0, 16, 128, 512])
        model.observe(num_tokens, num_seqs, a + b * num_tokens + c * num_seqs)


def test_not_ready_until_enough_samples_of_two_sizes() -> None:
    model = StepCostModel(min_samples=3)
    for _ in range(10):
        model.observe(8, 8, 0.01)
    assert not model.is_ready
    assert model.max_batched_tokens(0.05, 8) is None
    assert model.prefill_tokens_per_s() is None
    assert model.decode_tokens_per_s(8) is None
    model.observe(100, 8, 0.02)
    assert model.is_ready
    assert model.num_samples == 11


def test_recovers_a_line_exactly() -> None:
    model = StepCostModel()
    feed(model, 0.004, 2e-5)
    a, b = model.coefficients
    assert a == pytest.approx(0.004, rel=1e-6)
    assert b == pytest.approx(2e-5, rel=1e-6)
    assert model.predict(1000, 4) == pytest.approx(0.024, rel=1e-6)
    # The inverse: the most tokens whose predicted step stays within 10 ms.
    assert model.max_batched_tokens(0.010, 4) in (299, 300)
    assert model.max_batched_tokens(0.001, 4) == 0
    assert model.prefill_tokens_per_s() == pytest.approx(50_000, rel=1e-6)
    assert model.decode_tokens_per_s(10) == pytest.approx(10 / (0.004 + 10 * 2e-5), rel=1e-6)


def test_per_sequence_term_when_enabled() -> None:
    model = StepCostModel(use_num_seqs=True)
    feed(model, 0.003, 1e-5, 4e-4)
    a, b, c = model.coefficients
    assert (a, b, c) == pytest.approx((0.003, 1e-5, 4e-4), rel=1e-5)
    budget = model.max_batched_tokens(0.02, 10)
    assert budget is not None
    assert model.predict(budget, 10) <= 0.02 < model.predict(budget + 1, 10)


def test_forgets_old_steps() -> None:
    model = StepCostModel(decay=0.9)
    feed(model, 0.002, 1e-5)
    feed(model, 0.002, 4e-5, seed=1)  # the machine got 4x slower per token
    feed(model, 0.002, 4e-5, seed=2)
    assert model.coefficients[1] == pytest.approx(4e-5, rel=0.01)
    frozen = StepCostModel(decay=1.0)
    feed(frozen, 0.002, 1e-5)
    feed(frozen, 0.002, 4e-5, seed=1)
    assert frozen.coefficients[1] < 3.5e-5


def test_bad_samples_are_ignored() -> None:
    model = StepCostModel(min_samples=2)
    model.observe(10, 1, math.nan)
    model.observe(10, 1, -1.0)
    model.observe(0, 0, 0.5)
    model.observe(10, 1, math.inf)
    assert model.num_samples == 0
    assert model.measured_tokens_per_s() is None
    model.observe(10, 1, 0.01)
    model.observe(30, 1, 0.02)
    assert model.measured_tokens_per_s() == pytest.approx(40 / 0.03, rel=0.02)


def test_flat_or_falling_time_sets_no_limit() -> None:
    model = StepCostModel(min_samples=2)
    model.observe(10, 1, 0.02)
    model.observe(500, 1, 0.01)
    assert model.coefficients[1] < 0
    assert model.max_batched_tokens(0.001, 1) is None
    assert model.prefill_tokens_per_s() is None


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        StepCostModel(min_samples=1)
    with pytest.raises(ValueError, match="decay"):
        StepCostModel(decay=0.0)


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(1e-4, 0.05),
    b=st.floats(1e-7, 1e-3),
    slo_s=st.floats(1e-3, 0.5),
    num_seqs=st.integers(1, 64),
)
def test_max_batched_tokens_respects_the_step_time(a, b, slo_s, num_seqs) -> None:
    model = StepCostModel()
    feed(model, a, b)
    limit = model.max_batched_tokens(slo_s, num_seqs)
    assert limit is not None
    assert limit >= 0
    if limit > 0:
        assert model.predict(limit, num_seqs) <= slo_s * (1 + 1e-9)
    assert model.predict(limit + 2, num_seqs) > slo_s
