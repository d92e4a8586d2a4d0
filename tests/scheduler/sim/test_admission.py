"""The simulated gateway's SLO admission: drain rate over a window, predicted wait."""

from __future__ import annotations

import math

import pytest

from scheduler.sim.admission import SLO_UNATTAINABLE, DrainRate, admit, predicted_wait_s


def test_drain_rate_counts_tokens_in_the_window_only() -> None:
    rate = DrainRate(window_s=10)
    for t in range(20):
        rate.add(float(t), 100)
    # Events at 9..19 are inside (19 - 10, 19]: 11 events of 100 tokens over 10 s.
    assert rate.tokens_per_s(19.0) == pytest.approx(110.0)
    assert rate.tokens_per_s(100.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        DrainRate(window_s=0)


def test_predicted_wait_and_the_decision() -> None:
    assert predicted_wait_s(0, 0) == 0.0
    assert math.isinf(predicted_wait_s(10, 0))
    assert predicted_wait_s(5000, 1000) == pytest.approx(5.0)
    assert admit(None, 1e9) is None  # no TTFT SLO: only queue caps bound it
    assert admit(2000.0, 1.0) is None
    assert admit(2000.0, 1.5) == SLO_UNATTAINABLE  # beyond 70% of the SLO
    assert admit(2000.0, 1.5, headroom=1.0) is None
