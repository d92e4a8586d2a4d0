"""Workload generation: rates, burstiness, surges, windows, lengths, determinism."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from scheduler.sim.workload import (
    LengthDist,
    Surge,
    TenantSpec,
    TierSpec,
    WorkloadError,
    WorkloadSpec,
    generate,
    many_tenants_mix,
    three_tier_mix,
)

TIER = TierSpec("t", 0, ttft_slo_ms=100.0)


def _gaps(spec: WorkloadSpec) -> list[float]:
    times = [r.arrival_s for r in generate(spec)]
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_rate_and_gamma_burstiness() -> None:
    tenants = (TenantSpec("a", "t"),)
    poisson = WorkloadSpec((TIER,), tenants, rate_per_s=50, duration_s=200, seed=1)
    reqs = generate(poisson)
    assert len(reqs) == pytest.approx(10_000, rel=0.05)
    gaps = _gaps(poisson)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)
    bursty = WorkloadSpec((TIER,), tenants, 50, 200, arrival="gamma", burstiness_cv=3.0, seed=1)
    gaps = _gaps(bursty)
    assert len(gaps) == pytest.approx(10_000, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(3.0, rel=0.15)


def test_surges_windows_and_shares() -> None:
    spec = WorkloadSpec(
        (TIER,),
        (TenantSpec("a", "t", load_share=3), TenantSpec("b", "t", on_windows_s=((0, 50),))),
        rate_per_s=40,
        duration_s=100,
        surges=(Surge(60, 20, 4.0),),
        seed=3,
    )
    reqs = generate(spec)
    a = [r for r in reqs if r.tenant_id == "a"]
    b = [r for r in reqs if r.tenant_id == "b"]
    assert all(r.arrival_s < 50 for r in b)
    assert len(b) == pytest.approx(10 * 50, rel=0.15)
    in_surge = sum(1 for r in a if 60 <= r.arrival_s < 80)
    before = sum(1 for r in a if 20 <= r.arrival_s < 40)
    assert in_surge / before == pytest.approx(4.0, rel=0.2)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert generate(spec) == reqs  # deterministic for a seed


def test_overlapping_surges_multiply_the_rate() -> None:
    def rate_in(surges: tuple[Surge, ...], start_s: float, end_s: float) -> float:
        spec = WorkloadSpec((TIER,), (TenantSpec("a", "t"),), 50, 100, surges=surges, seed=1)
        reqs = generate(spec)
        return sum(1 for r in reqs if start_s <= r.arrival_s < end_s) / (end_s - start_s)

    stacked = (Surge(40, 20, 2.0), Surge(40, 20, 3.0))
    # Thinning a stream drawn at the largest single multiplier capped this at 3x (150).
    assert rate_in(stacked, 40, 60) == pytest.approx(300, rel=0.1)
    assert rate_in((Surge(40, 20, 6.0),), 40, 60) == pytest.approx(300, rel=0.1)
    assert rate_in(stacked, 0, 40) == pytest.approx(50, rel=0.1)
    assert rate_in(stacked, 60, 100) == pytest.approx(50, rel=0.1)
    # Partly overlapping: 2x, then 6x, then 3x; a zero multiplier silences the stream.
    partial = (Surge(20, 20, 2.0), Surge(30, 20, 3.0), Surge(70, 10, 0.0))
    assert rate_in(partial, 20, 30) == pytest.approx(100, rel=0.15)
    assert rate_in(partial, 30, 40) == pytest.approx(300, rel=0.1)
    assert rate_in(partial, 40, 50) == pytest.approx(150, rel=0.15)
    assert rate_in(partial, 70, 80) == 0


def test_a_surge_keeps_the_gamma_burstiness_around_it() -> None:
    spec = WorkloadSpec(
        (TIER,),
        (TenantSpec("a", "t"),),
        50,
        400,
        arrival="gamma",
        burstiness_cv=3.0,
        surges=(Surge(390, 10, 10.0),),
        seed=2,
    )
    times = [r.arrival_s for r in generate(spec)]
    before = [b - a for a, b in itertools.pairwise(t for t in times if t < 390)]
    # Drawn at the surge's peak rate and thinned, the gaps were near Poisson (CV ~1.3).
    assert statistics.stdev(before) / statistics.mean(before) == pytest.approx(3.0, rel=0.15)
    assert len(before) == pytest.approx(50 * 390, rel=0.1)
    assert sum(1 for t in times if t >= 390) == pytest.approx(500 * 10, rel=0.35)


def test_length_distributions() -> None:
    rng = random.Random(0)
    lognormal = LengthDist("lognormal", mean=200, sigma=0.5, low=1, high=100_000)
    values = [lognormal.sample(rng) for _ in range(20_000)]
    assert statistics.mean(values) == pytest.approx(200, rel=0.03)
    clipped = LengthDist("uniform", low=5, high=9)
    assert {clipped.sample(rng) for _ in range(500)} == {5, 6, 7, 8, 9}
    assert LengthDist("fixed", mean=33).sample(rng) == 33


def test_three_tier_and_many_tenant_mixes() -> None:
    reqs = generate(three_tier_mix(20, 60, seed=2))
    by_tier = {t: sum(1 for r in reqs if r.tier == t) for t in ("priority", "interactive", "batch")}
    assert by_tier["interactive"] > by_tier["batch"] > by_tier["priority"] > 0
    batch = next(r for r in reqs if r.tier == "batch")
    assert batch.deadline_s == pytest.approx(batch.arrival_s + 86_400)
    assert batch.ttft_slo_ms is None
    assert batch.preemptible
    spec = many_tenants_mix(100, 10, 1000)
    assert len(spec.tenants) == 1000
    assert len({r.tenant_id for r in generate(spec)}) > 300


def test_clients_asking_max_tokens_stop_at_their_drawn_lengths() -> None:
    exact = generate(three_tier_mix(20, 30, seed=3))
    asking = generate(three_tier_mix(20, 30, seed=3, max_tokens=512))
    # The same arrivals and draws: only what is asked, and the lengths cut at 512, differ.
    assert [r.request_id for r in exact] == [r.request_id for r in asking]
    for plain, capped in zip(exact, asking, strict=True):
        assert plain.max_tokens is None
        assert plain.asked_tokens == plain.num_output_tokens
        assert capped.num_output_tokens == min(plain.num_output_tokens, 512)
        assert capped.asked_tokens == 512
    assert any(r.num_output_tokens > 512 for r in exact)
    with pytest.raises(WorkloadError, match="max_tokens"):
        TierSpec("t", 0, max_tokens=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate_per_s": -1}, "rate_per_s"),
        ({"duration_s": 0}, "duration_s"),
        ({"arrival": "weibull"}, "arrival"),
        ({"tenants": (TenantSpec("a", "nope"),)}, "unknown tier"),
        ({"tenants": (TenantSpec("a", "t", weight=0),)}, "weight"),
        # NaN passes every comparison: each of these hung, or failed later untyped.
        ({"arrival": "gamma", "burstiness_cv": math.nan}, "burstiness_cv"),
        ({"arrival": "gamma", "burstiness_cv": 1e6}, "burstiness_cv"),
        ({"surges": (Surge(1, 2, math.inf),)}, "surge"),
        ({"surges": (Surge(1, 2, math.nan),)}, "surge"),
        ({"surges": (Surge(1, math.nan, 2),)}, "surge"),
        ({"surges": (Surge(math.nan, 2, 2),)}, "surge"),
        ({"surges": (Surge(0, 1, 1e200), Surge(0, 1, 1e200))}, "surge"),
        ({"tenants": (TenantSpec("a", "t", weight=math.nan),)}, "weight"),
        ({"tenants": (TenantSpec("a", "t", weight=math.inf),)}, "weight"),
        ({"tenants": (TenantSpec("a", "t", load_share=math.inf),)}, "load_share"),
        ({"tenants": (TenantSpec("a", "t", load_share=math.nan),)}, "load_share"),
        ({"tenants": (TenantSpec("a", "t"), TenantSpec("a", "t"))}, "twice"),
        ({"tiers": (TIER, TIER)}, "twice"),
        (
            {
                "tiers": (TierSpec("t", 0, min_share=0.6), TierSpec("u", 1, min_share=0.5)),
                "tenants": (TenantSpec("a", "t"), TenantSpec("b", "u")),
            },
            "min_share",
        ),
    ],
)
def test_invalid_workloads_raise(kwargs: dict, match: str) -> None:
    base = {"tiers": (TIER,), "tenants": (TenantSpec("a", "t"),), "rate_per_s": 1, "duration_s": 1}
    with pytest.raises(WorkloadError, match=match):
        WorkloadSpec(**{**base, **kwargs})
    with pytest.raises(WorkloadError):
        LengthDist("zipf")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LengthDist("lognormal", mean=math.nan), "mean"),
        (lambda: LengthDist("lognormal", mean=math.inf), "mean"),
        (lambda: LengthDist("lognormal", sigma=math.nan), "sigma"),
        (lambda: LengthDist("uniform", low=1.5, high=4), "whole"),
        # A 10^9-token prompt hung the engine building it; no context holds one.
        (lambda: LengthDist("fixed", mean=1e9, high=10**9), "high"),
        (lambda: TierSpec("t", 0, max_queue_ms=-1), "max_queue_ms"),
        (lambda: TierSpec("t", 0, max_queue_ms=math.nan), "max_queue_ms"),
        (lambda: TierSpec("t", 0, completion_window_s=-1), "completion_window_s"),
        (lambda: TierSpec("t", 0, ttft_slo_ms=0), "ttft_slo_ms"),
        (lambda: TierSpec("t", 0, tpot_slo_ms=math.nan), "tpot_slo_ms"),
        (lambda: TierSpec("t", 0, min_share=1.0), "min_share"),
        (lambda: TierSpec("t", 0, min_share=math.nan), "min_share"),
        (lambda: TierSpec("t", -1), "rank"),
        (lambda: TierSpec("t", 0, max_queued_jobs=0), "max_queued_jobs"),
    ],
)
def test_invalid_tiers_and_lengths_raise(make, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        make()


def test_the_admin_apis_min_share_sum_of_one_is_taken() -> None:
    tiers = (TierSpec("t", 0, min_share=0.7), TierSpec("u", 1, min_share=0.3))
    spec = WorkloadSpec(tiers, (TenantSpec("a", "t"),), 1, 1)
    assert sum(t.min_share for t in spec.tiers) == pytest.approx(1.0)
