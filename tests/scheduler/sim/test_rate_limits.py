"""The gateway's rate limits in the simulation: the real limiter on the virtual clock,
in front of every policy, with the gateway's refusal codes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.admission import RATE_LIMIT_CODES
from scheduler.rate_limit import TenantLimits
from scheduler.sim.cost_model import RooflineParams, load_preset
from scheduler.sim.fleet import POLICIES, FleetSpec, SimOptions, simulate
from scheduler.sim.rate_limits import LIMIT_CODES
from scheduler.sim.workload import (
    SEEDED_LIMITS,
    LengthDist,
    TenantSpec,
    TierSpec,
    WorkloadError,
    WorkloadSpec,
    provisioned_limits,
    three_tier_mix,
    three_tier_tiers,
)

H200 = load_preset("h200-llama-3.1-8b")
SHORT = dict(prompt_len=LengthDist("fixed", mean=64), output_len=LengthDist("fixed", mean=16))


def _spec(limits: TenantLimits, rate_per_s: float, duration_s: float = 30) -> WorkloadSpec:
    tier = TierSpec("t", 1, ttft_slo_ms=2000, limits=limits, **SHORT)
    tenants = (
        TenantSpec("heavy", "t", load_share=1.0),
        TenantSpec("free", "t", load_share=1.0, limits=TenantLimits(rpm=100_000)),
    )
    return WorkloadSpec((tier,), tenants, rate_per_s, duration_s, seed=3)


def _refusals(
    spec: WorkloadSpec, policy: str, params: RooflineParams = H200, **options
) -> dict[str, dict[str, int]]:
    """Refusal codes per tenant, with the tenant's offered count under "offered"."""
    result = simulate(spec, policy, FleetSpec(params, 1), SimOptions(keep_records=True, **options))
    out: dict[str, dict[str, int]] = {}
    for record in result.collector.records:
        by_code = out.setdefault(record.request.tenant_id, {"offered": 0})
        by_code["offered"] += 1
        if record.rejected_code is not None:
            by_code[record.rejected_code] = by_code.get(record.rejected_code, 0) + 1
    return out


def test_codes_are_the_gateways() -> None:
    assert LIMIT_CODES == RATE_LIMIT_CODES


@pytest.mark.parametrize("policy", POLICIES)
def test_over_rpm_tenant_is_refused_under_every_policy(policy: str) -> None:
    # Each tenant sends ~5 requests/s = ~300 a minute against 120 rpm: the bucket's
    # first minute's worth (120) passes, then only its refill (2/s).
    spec = _spec(TenantLimits(rpm=120), rate_per_s=10, duration_s=60)
    refused = _refusals(spec, policy)
    heavy = refused["heavy"]
    assert set(heavy) == {"offered", "rate_limit_exceeded"}
    admitted = heavy["offered"] - heavy["rate_limit_exceeded"]
    assert 120 + 2 * 50 <= admitted <= 120 + 2 * 60
    assert set(refused["free"]) == {"offered"}  # its own override lifts the tier's limit


def test_tpm_and_concurrency_limits_refuse_with_their_codes() -> None:
    # 80 tokens a request; 2,400 tpm lets ~30 a minute through once the bucket is spent.
    refused = _refusals(_spec(TenantLimits(tpm=2_400), rate_per_s=4, duration_s=40), "fcfs")
    assert set(refused["heavy"]) == {"offered", "rate_limit_exceeded"}
    assert refused["heavy"]["rate_limit_exceeded"] > 20
    # One slot at a time: a request arriving while another is in flight is refused.
    long = TierSpec(
        "t",
        1,
        limits=TenantLimits(max_concurrency=1),
        prompt_len=LengthDist("fixed", mean=64),
        output_len=LengthDist("fixed", mean=400),  # ~3 s of decoding
    )
    spec = WorkloadSpec((long,), (TenantSpec("heavy", "t"),), 2, 30, seed=1)
    refused = _refusals(spec, "tiered")
    assert set(refused["heavy"]) == {"offered", "concurrency_limit_exceeded"}
    assert refused["heavy"]["concurrency_limit_exceeded"] > 30


def test_finished_requests_free_their_slot_and_limits_can_be_switched_off() -> None:
    # Requests ~0.15 s long arriving every ~2 s rarely overlap: a cap of one refuses only
    # those few once each finished request hands its slot back (all but one if it did not).
    spec = _spec(TenantLimits(max_concurrency=1), rate_per_s=1, duration_s=60)
    heavy = _refusals(spec, "priority")["heavy"]
    assert heavy["offered"] > 15
    assert heavy.get("concurrency_limit_exceeded", 0) <= 3
    flood = _spec(TenantLimits(rpm=60), rate_per_s=20, duration_s=20)
    assert _refusals(flood, "vtc")["heavy"]["rate_limit_exceeded"] > 100
    assert set(_refusals(flood, "vtc", rate_limits=False)["heavy"]) == {"offered"}


def test_a_refused_request_gives_back_its_reservation() -> None:
    # A TTFT SLO below a request's own prefill, behind a better rank's steady work that
    # fills every sequence slot: SLO admission refuses every request that has work ahead
    # of it, after the limiter admitted it. With the reservation handed back, the cap of
    # one never bites.
    tight = TierSpec("t", 1, ttft_slo_ms=0.001, limits=TenantLimits(max_concurrency=1), **SHORT)
    ahead = TierSpec(
        "ahead",
        0,
        prompt_len=LengthDist("fixed", mean=64),
        output_len=LengthDist("fixed", mean=400),
    )
    tenants = (TenantSpec("a", "t", load_share=0.1), TenantSpec("b", "ahead", load_share=0.9))
    spec = WorkloadSpec((tight, ahead), tenants, 50, 20, seed=2)
    refused = _refusals(spec, "tiered", replace(H200, max_num_seqs=32))["a"]
    assert refused["offered"] > 50
    # Refused by SLO but for the few that found nothing ahead (served at best effort,
    # holding the slot while they ran). A reservation kept by a refused request would
    # have turned every later one into a concurrency refusal.
    assert refused["slo_unattainable"] >= refused["offered"] - 10
    assert refused.get("concurrency_limit_exceeded", 0) <= 5


def test_provisioned_limits_cover_the_share_with_headroom_and_keep_the_defaults() -> None:
    tiers = {t.name: t for t in three_tier_tiers()}
    interactive = tiers["interactive"]
    light = provisioned_limits(interactive, 0.1, 2.0)
    assert light == SEEDED_LIMITS["interactive"]  # the defaults already cover it
    heavy = provisioned_limits(interactive, 5.0, 2.0)
    assert heavy.rpm == 600  # 2 x 300 requests a minute
    assert heavy.tpm == 2 * 300 * (768 + 256)
    # Little's law at the SLO's edge: 2 s + 100 ms x 256 tokens = 27.6 s in flight.
    assert heavy.max_concurrency == 276
    batch = provisioned_limits(tiers["batch"], 5.0, 2.0)
    assert batch.rpm is None  # the tier sets no rpm cap
    assert batch.max_concurrency == 64  # no latency SLO: the default bounds its backlog
    assert three_tier_tiers(rate_limits=False)[0].limits == TenantLimits()
    with pytest.raises(WorkloadError, match="headroom"):
        provisioned_limits(interactive, 1.0, 0.0)


def test_three_tier_mix_provisions_for_a_rate_that_a_sweep_keeps() -> None:
    low = three_tier_mix(30, 10, provisioned_rate_per_s=30)
    high = three_tier_mix(60, 10, provisioned_rate_per_s=30)
    assert [t.limits for t in low.tenants] == [t.limits for t in high.tenants]
    own = three_tier_mix(60, 10)
    assert own.tenants[2].limits.tpm > low.tenants[2].limits.tpm


def test_tenant_override_replaces_only_the_limits_it_sets() -> None:
    tier = TierSpec("t", 1, limits=TenantLimits(rpm=10, tpm=1000, max_concurrency=2))
    tenant = TenantSpec("a", "t", limits=TenantLimits(tpm=5000))
    assert tenant.effective_limits(tier) == TenantLimits(rpm=10, tpm=5000, max_concurrency=2)
    assert TenantSpec("b", "t").effective_limits(tier) == tier.limits
