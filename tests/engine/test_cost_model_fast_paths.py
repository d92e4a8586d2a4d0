"""The step cost model's two-coefficient fast paths give the same bits as the general
code (the step scheduler's budgets, and so every simulated and served plan, read them)."""

from __future__ import annotations

import math
import random

import pytest

from engine.cost_model import StepCostModel, _solve_ridge_2, _solve_ridge_any


def _random_system(rng: random.Random) -> tuple[list[list[float]], list[float]]:
    kind = rng.random()
    if kind < 0.2:  # every step the same size: singular without the ridge
        n = float(rng.randint(1, 300))
        s = rng.uniform(0.5, 50)
        xtx = [[s, s * n], [s * n, s * n * n]]
    elif kind < 0.3:  # a tie between the pivot candidates
        a = rng.uniform(-5, 5)
        xtx = [[a, rng.uniform(-5, 5)], [-a, rng.uniform(-5, 5)]]
    elif kind < 0.35:  # nothing observed
        xtx = [[0.0, 0.0], [0.0, 0.0]]
    else:
        xtx = [[rng.uniform(-1e6, 1e6) for _ in range(2)] for _ in range(2)]
    xty = [rng.uniform(-10, 10), rng.choice([0.0, -0.0, rng.uniform(-1e4, 1e4)])]
    return xtx, xty


def test_two_coefficient_solve_matches_the_general_elimination_bit_for_bit() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        xtx, xty = _random_system(rng)
        fast = _solve_ridge_2([row[:] for row in xtx], xty[:])
        general = _solve_ridge_any([row[:] for row in xtx], xty[:])
        assert [math.copysign(1, c) for c in fast] == [math.copysign(1, c) for c in general]
        assert fast == general or all(
            math.isnan(a) and math.isnan(b) for a, b in zip(fast, general, strict=True)
        )


def _observe_generally(model: StepCostModel, tokens: int, seqs: int, step_s: float) -> None:
    """StepCostModel.observe's general loop, for comparison."""
    x = model._features(tokens, seqs)
    for i, xi in enumerate(x):
        row = model._xtx[i]
        for j, xj in enumerate(x):
            row[j] = model.decay * row[j] + xi * xj
        model._xty[i] = model.decay * model._xty[i] + xi * step_s


@pytest.mark.parametrize("decay", [0.98, 1.0, 0.5])
def test_two_feature_observe_matches_the_general_loop(decay: float) -> None:
    rng = random.Random(3)
    fast, general = StepCostModel(decay=decay), StepCostModel(decay=decay)
    for _ in range(5_000):
        tokens, seqs, step_s = rng.randint(1, 9000), rng.randint(1, 256), rng.uniform(0, 0.2)
        fast.observe(tokens, seqs, step_s)
        _observe_generally(general, tokens, seqs, step_s)
        assert fast._xtx == general._xtx
        assert fast._xty == general._xty
    assert fast.coefficients == tuple(_solve_ridge_any(general._xtx, general._xty))
