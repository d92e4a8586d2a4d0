"""PhaseRates: prefill and decode rates from measured steps, mixed steps split by the fit."""

from __future__ import annotations

import math

import pytest

from engine.cost_model import StepCostModel
from engine.phase_rates import PhaseRates

# A machine whose step costs exactly OVERHEAD_S + SECONDS_PER_TOKEN * tokens.
OVERHEAD_S = 0.004
SECONDS_PER_TOKEN = 2e-5


def _step_s(num_tokens: int) -> float:
    return OVERHEAD_S + SECONDS_PER_TOKEN * num_tokens


def _run(model: StepCostModel, rates: PhaseRates, num_prefill: int, num_decode: int) -> None:
    """Execute one step as the engine does: feed the cost model, then the rates."""
    num_tokens = num_prefill + num_decode
    num_seqs = num_decode + (1 if num_prefill else 0)
    model.observe(num_tokens, num_seqs, _step_s(num_tokens))
    rates.record(num_prefill, num_decode, num_seqs, _step_s(num_tokens))


def test_mixed_steps_keep_the_decode_rate_current() -> None:
    # An engine held at max_num_seqs: every step decodes the running requests and
    # prefills a newcomer. The decode rate must follow the batch as it grows.
    model = StepCostModel()
    rates = PhaseRates(model)
    for num_prefill in (100, 300, 200, 500, 150, 400, 250, 350):
        _run(model, rates, num_prefill, 4)
    assert model.is_ready
    for _ in range(200):
        _run(model, rates, 300, 60)
    assert rates.decode_tokens_per_s == pytest.approx(60 / _step_s(60), rel=1e-3)
    # Prompt tokens per second of the steps they dominate, the decodes' time included.
    assert rates.prefill_tokens_per_s == pytest.approx(300 / _step_s(360), rel=1e-3)


def test_a_mixed_step_charges_its_prompt_tokens_their_marginal_cost() -> None:
    model = StepCostModel()
    rates = PhaseRates(model)
    for num_tokens in (10, 20, 40, 80, 160, 320, 640, 1280):
        model.observe(num_tokens, 1, _step_s(num_tokens))
    # Measured twice as slow as the fit: the decodes' share of the time doubles too.
    rates.record(500, 20, 21, 2 * _step_s(520))
    assert rates.decode_tokens_per_s == pytest.approx(0.5 * 20 / _step_s(20), rel=1e-6)
    assert rates.prefill_tokens_per_s == pytest.approx(500 / (2 * _step_s(520)), rel=1e-6)


def test_pure_steps_count_whole_for_their_phase() -> None:
    model = StepCostModel()
    rates = PhaseRates(model)
    for num_tokens in (10, 20, 40, 80, 160, 320, 640, 1280):
        model.observe(num_tokens, 1, _step_s(num_tokens))
    rates.record(0, 32, 32, _step_s(32))
    rates.record(2048, 0, 1, _step_s(2048))
    assert rates.decode_tokens_per_s == pytest.approx(32 / _step_s(32))
    assert rates.prefill_tokens_per_s == pytest.approx(2048 / _step_s(2048))


def test_before_the_fit_only_pure_decode_steps_sample_the_decode_rate() -> None:
    rates = PhaseRates(StepCostModel())
    rates.record(3, 5, 5, 0.01)  # decode-dominated mixed step: no clean sample yet
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (0.0, 0.0)
    rates.record(0, 5, 5, 0.01)
    rates.record(90, 5, 6, 0.1)
    assert rates.decode_tokens_per_s == pytest.approx(500.0)
    assert rates.prefill_tokens_per_s == pytest.approx(900.0)
    # Without a cost model at all the same rule applies.
    plain = PhaseRates()
    plain.record(90, 5, 6, 0.1)
    plain.record(3, 5, 5, 0.01)
    assert plain.prefill_tokens_per_s == pytest.approx(900.0)
    assert plain.decode_tokens_per_s == 0.0


@pytest.mark.parametrize("step_s", [0.0, -1.0, math.inf, math.nan])
def test_unusable_times_are_ignored(step_s: float) -> None:
    rates = PhaseRates(StepCostModel())
    rates.record(10, 10, 10, step_s)
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (0.0, 0.0)


def test_a_flat_fit_gives_the_whole_mixed_step_to_the_decodes() -> None:
    model = StepCostModel()
    rates = PhaseRates(model)
    for num_tokens in (10, 20, 40, 80, 160, 320, 640, 1280):
        model.observe(num_tokens, 1, 0.01)  # time does not grow with tokens
    rates.record(4, 8, 9, 0.01)
    assert rates.decode_tokens_per_s == pytest.approx(800.0)
