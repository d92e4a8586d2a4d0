"""Step-time noise: the table and its checks, the fit, the stream, and the simulator's
steps under it."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from scheduler.sim.cost_model import (
    CostModelError,
    StepSample,
    StepShape,
    load_params,
    load_preset,
    save_params,
    with_step_noise,
)
from scheduler.sim.fleet import FleetSpec, SimOptions, simulate
from scheduler.sim.step_noise import (
    PROBABILITIES,
    NoiseStream,
    StepNoise,
    StepNoiseError,
    fit_step_noise,
)
from scheduler.sim.workload import three_tier_mix

H200 = load_preset("h200-llama-3.1-8b")
# Heavy upper tail, as a shared host's steps have: 1% of steps 3x, 0.1% 8x the median.
TABLE = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.05, 1.25, 1.5, 3.0, 8.0)


def _draws(noise: StepNoise, n: int, seed: str = "s") -> list[float]:
    stream = NoiseStream(noise, seed)
    return [stream.at(i) for i in range(n)]


@pytest.mark.parametrize(
    ("quantiles", "autocorr", "match"),
    [
        (TABLE[:-1], 0.5, "needs 11 quantiles"),
        ((*TABLE[:-2], 0.5, 8.0), 0.5, "must not decrease"),
        ((0.0, *TABLE[1:]), 0.5, "within"),
        ((*TABLE[:-1], float("inf")), 0.5, "within"),
        ((*TABLE[:-1], float("nan")), 0.5, "within"),
        ((True, *TABLE[1:]), 0.5, "must be numbers"),
        ((*TABLE[:-1], "8"), 0.5, "must be numbers"),
        (TABLE, 1.0, "autocorr"),
        (TABLE, -0.1, "autocorr"),
        (TABLE, True, "autocorr"),
        (TABLE, float("nan"), "autocorr"),
    ],
)
def test_a_table_that_describes_no_step_times_is_refused(quantiles, autocorr, match) -> None:
    with pytest.raises(StepNoiseError, match=match):
        StepNoise(quantiles, autocorr)


def test_multipliers_follow_the_table_and_stay_within_its_ends() -> None:
    noise = StepNoise(TABLE, 0.0)
    draws = sorted(_draws(noise, 50_000))
    for p, q in zip(PROBABILITIES[1:-1], TABLE[1:-1], strict=True):
        assert draws[int(p * len(draws))] == pytest.approx(q, rel=0.05)
    assert TABLE[0] <= draws[0]
    assert draws[-1] <= TABLE[-1]
    assert statistics.fmean(draws) == pytest.approx(noise.mean(), rel=0.02)


def test_the_stream_gives_a_step_index_the_same_multiplier_however_it_is_asked() -> None:
    noise = StepNoise(TABLE, 0.8)
    stream = NoiseStream(noise, "engine-0")
    ahead = [stream.at(i) for i in range(100)]  # a fast-forwarded run planned ahead
    stream.forget_before(40)
    assert [stream.at(i) for i in range(40, 150)][:60] == ahead[40:]
    # A stream of the same seed asked one step at a time gives the same sequence.
    assert _draws(noise, 150, "engine-0")[40:] == [stream.at(i) for i in range(40, 150)]
    other = NoiseStream(noise, "engine-1")
    assert [other.at(i) for i in range(100)] != ahead


def test_the_fit_recovers_the_table_with_mean_one_and_the_stretches() -> None:
    truth = StepNoise(tuple(q / StepNoise(TABLE, 0.0).mean() for q in TABLE), 0.85)
    ratios = _draws(truth, 60_000)
    fitted = fit_step_noise(ratios)
    assert fitted.mean() == pytest.approx(1.0, abs=0.01)
    for got, want in zip(fitted.quantiles[1:-1], truth.quantiles[1:-1], strict=True):
        assert got == pytest.approx(want, rel=0.1)
    assert fitted.autocorr == pytest.approx(0.85, abs=0.05)
    # Independent steps: no stretches.
    assert fit_step_noise(_draws(replace(truth, autocorr=0.0), 20_000)).autocorr < 0.1


def test_the_fit_scales_any_ratios_to_mean_one() -> None:
    # Steps 20% slower than predicted throughout (a roofline fitted elsewhere): the
    # offset belongs to the roofline, the noise only shapes the spread.
    ratios = [1.2 * r for r in _draws(StepNoise(TABLE, 0.5), 5_000)]
    assert fit_step_noise(ratios).mean() == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize(
    ("ratios", "match"),
    [([1.0] * 999, "at least 1000 steps"), ([1.0] * 999 + [float("nan")], "finite and > 0")],
)
def test_the_fit_refuses_what_tells_no_noise(ratios, match) -> None:
    with pytest.raises(StepNoiseError, match=match):
        fit_step_noise(ratios)


def test_step_noise_travels_in_the_parameter_file(tmp_path) -> None:
    params = replace(H200, step_noise=StepNoise(TABLE, 0.6))
    save_params(params, tmp_path / "noisy.json")
    assert load_params(tmp_path / "noisy.json") == params
    data = json.loads((tmp_path / "noisy.json").read_text())
    assert data["step_noise"] == {"quantiles": list(TABLE), "autocorr": 0.6}
    for bad, match in [
        ({"quantiles": [1.0] * 3, "autocorr": 0.5}, "needs 11 quantiles"),
        ({"quantiles": "1,2", "autocorr": 0.5}, "must be a list"),
        ({"quantiles": list(TABLE), "rho": 0.5}, "unknown step_noise fields: rho"),
        ([1, 2], "must be an object or null"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**data, "step_noise": bad}))
        with pytest.raises(CostModelError, match=match):
            load_params(tmp_path / "bad.json")


def test_with_step_noise_fits_the_samples_around_the_prediction() -> None:
    shape = StepShape(8, 8_000, num_seqs=8)
    predicted = H200.shape_time_s(shape)
    ratios = _draws(StepNoise(TABLE, 0.0), 20_000)
    noisy = with_step_noise(H200, [StepSample(shape, predicted * r) for r in ratios])
    assert noisy.step_noise is not None
    # P99 against the median, as drawn (the fit scales the table, not its shape).
    assert noisy.step_noise.quantiles[-2] / noisy.step_noise.quantiles[5] == pytest.approx(
        3.0 / 0.95, rel=0.1
    )
    with pytest.raises(CostModelError, match="at least 1000"):
        with_step_noise(H200, [StepSample(shape, predicted)] * 10)


def test_noisy_steps_keep_throughput_and_lengthen_the_tails() -> None:
    spec = three_tier_mix(20, 20, seed=5)
    noisy = replace(H200, step_noise=fit_step_noise(_draws(StepNoise(TABLE, 0.9), 5_000)))
    plain, run = (
        simulate(spec, "tiered", FleetSpec(p, 1), SimOptions(drain_s=60)) for p in (H200, noisy)
    )
    for tier in ("priority", "interactive"):
        assert run.stats.tiers[tier].tpot_p99_ms > 1.15 * plain.stats.tiers[tier].tpot_p99_ms
        assert run.stats.tiers[tier].ttft_p99_ms > plain.stats.tiers[tier].ttft_p99_ms
    # The same work in about the same engine time: the multipliers' mean is 1 (the
    # steps differ, as batches form differently, hence no exact match).
    assert [t.num_finished for t in run.stats.tiers.values()] == [
        t.num_finished for t in plain.stats.tiers.values()
    ]
    assert run.engines[0].busy_s == pytest.approx(plain.engines[0].busy_s, rel=0.05)


def test_fast_forward_takes_each_step_with_its_own_multiplier() -> None:
    params = replace(H200, step_noise=StepNoise(TABLE, 0.8))
    spec = three_tier_mix(30, 10, seed=3)
    runs = [
        simulate(
            spec, "tiered", FleetSpec(params, 2), SimOptions(keep_records=True, fast_forward=ff)
        )
        for ff in (False, True)
    ]
    exact, fast = ({r.request.request_id: r for r in run.collector.records} for run in runs)
    assert exact.keys() == fast.keys()
    for request_id, record in exact.items():
        assert fast[request_id].finish_s == pytest.approx(record.finish_s, abs=1e-9)
    plain = simulate(spec, "tiered", FleetSpec(H200, 2), SimOptions(keep_records=True))
    plain_finish = {r.request.request_id: r.finish_s for r in plain.collector.records}
    assert any(plain_finish[i] != pytest.approx(r.finish_s) for i, r in exact.items())
