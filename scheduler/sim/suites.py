"""The standard fairness suites (after the VTC paper), each with its pass/fail check.

Every suite runs tenants of one tier on one deliberately small engine so that it is
overloaded at a few requests per second, then measures service (the policy's weighted
tokens: input + 2 × output) per tenant from the simulator's service trace:

- two-overloaded: two tenants, both sending more than the engine serves → equal service.
- proportional: demand 1:2:3:4, all overloaded, equal weights → equal service.
- weighted: weights 1:2:3:4, all overloaded → service 1:2:3:4 within 2%.
- on-off: one tenant always on, one alternating → the alternating one never gets more
  than 55% of the service in its on periods (idling banks no credit).
- returning: one tenant backlogged throughout, one idle for the first half → in the
  10 s after it returns the returning tenant gets at most 55%.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.sim.cost_model import RooflineParams
from scheduler.sim.fleet import FleetSpec, SimOptions, simulate
from scheduler.sim.metrics import ServiceTrace, jain_index
from scheduler.sim.workload import LengthDist, TenantSpec, TierSpec, WorkloadSpec

SUITES = ("two-overloaded", "proportional", "weighted", "on-off", "returning")
# One small engine serves roughly 100 of these requests per second; every suite offers
# several times that so the tenants stay backlogged.
SUITE_RATE_PER_S = 150.0
# A suite's workload seed is this plus the run's seed: the suites drew with seed 11 alone
# before they took one, so seed 0 (the report's default) keeps their earlier results.
_SEED_OFFSET = 11

_TIER = TierSpec(
    "interactive",
    1,
    ttft_slo_ms=None,
    prompt_len=LengthDist("uniform", low=48, high=80),
    output_len=LengthDist("uniform", low=24, high=40),
)


def suite_engine(params: RooflineParams) -> RooflineParams:
    """The preset with eight sequence slots: saturated at a handful of requests/s."""
    return replace(params, max_num_seqs=8, max_num_batched_tokens=max(params.max_num_seqs, 512))


@dataclass(frozen=True)
class SuiteResult:
    suite: str
    policy: str
    metric: str
    value: float
    target: str
    passed: bool
    service: dict[str, float]  # weighted service per tenant in the measured window


def _spec(
    tenants: Sequence[TenantSpec], rate_per_s: float, duration_s: float, seed: int
) -> WorkloadSpec:
    return WorkloadSpec((_TIER,), tuple(tenants), rate_per_s, duration_s, seed=_SEED_OFFSET + seed)


def _service(trace: ServiceTrace, start_s: float, end_s: float) -> dict[str, float]:
    """Served tokens per tenant between the samples nearest to start_s and end_s."""
    first = min(range(len(trace.times_s)), key=lambda i: abs(trace.times_s[i] - start_s))
    last = min(range(len(trace.times_s)), key=lambda i: abs(trace.times_s[i] - end_s))
    a, b = trace.served[first], trace.served[last]
    return {t: b.get(t, 0.0) - a.get(t, 0.0) for t in b}


def run_suite(
    name: str, policy: str, params: RooflineParams, *, duration_s: float = 60.0, seed: int = 0
) -> SuiteResult:
    """Run one suite under one policy; the engine is `suite_engine(params)`, the
    arrivals drawn from `seed`."""
    result = _run_suite(name, policy, params, duration_s, seed)
    if not sum(result.service.values()) > 0:
        # Nothing served (every request refused, e.g. by a cache too small for them):
        # equal shares of nothing say nothing about fairness.
        return replace(result, passed=False)
    return result


def _run_suite(
    name: str, policy: str, params: RooflineParams, duration_s: float, seed: int
) -> SuiteResult:
    fleet = FleetSpec(suite_engine(params), 1)
    options = SimOptions(drain_s=0.0, sample_interval_s=0.5)
    warm = 0.2 * duration_s
    rate = SUITE_RATE_PER_S
    if name in ("two-overloaded", "proportional", "weighted"):
        if name == "two-overloaded":
            tenants = [
                TenantSpec("a", "interactive", 1.0, 2.0),
                TenantSpec("b", "interactive", 1.0, 1.0),
            ]
        elif name == "proportional":
            tenants = [TenantSpec(f"t{i}", "interactive", 1.0, float(i)) for i in range(1, 5)]
        else:
            tenants = [TenantSpec(f"w{i}", "interactive", float(i), 1.0) for i in range(1, 5)]
        result = simulate(_spec(tenants, rate, duration_s, seed), policy, fleet, options)
        service = _service(result.trace, warm, duration_s)
        # A tenant served nothing (every request refused, e.g. a cache too small for
        # them) is absent from the trace: its service is 0.
        weighted = [service.get(t.tenant_id, 0.0) / t.weight for t in tenants]
        if name == "weighted":
            mean = sum(weighted) / len(weighted)
            error = max(abs(w / mean - 1.0) for w in weighted) if mean > 0 else 1.0
            return SuiteResult(
                name,
                policy,
                "largest relative error of service/weight",
                error,
                "≤ 0.02",
                error <= 0.02,
                service,
            )
        jain = jain_index(weighted) or 0.0
        return SuiteResult(name, policy, "Jain's index", jain, "≥ 0.99", jain >= 0.99, service)
    if name == "on-off":
        period = duration_s / 6
        windows = tuple((2 * k * period, (2 * k + 1) * period) for k in range(3))
        tenants = [
            TenantSpec("steady", "interactive", 1.0, 1.0),
            TenantSpec("on-off", "interactive", 1.0, 1.0, on_windows_s=windows),
        ]
        result = simulate(_spec(tenants, rate, duration_s, seed), policy, fleet, options)
        shares = []
        for start, end in windows[1:]:
            service = _service(result.trace, start, end)
            total = sum(service.values())
            shares.append(service.get("on-off", 0.0) / total if total else 0.0)
        worst = max(shares)
        return SuiteResult(
            name,
            policy,
            "largest share of the on-off tenant while on",
            worst,
            "≤ 0.55",
            worst <= 0.55,
            service,
        )
    if name == "returning":
        back_s = duration_s / 2
        tenants = [
            TenantSpec("steady", "interactive", 1.0, 1.0),
            TenantSpec("returning", "interactive", 1.0, 1.0, on_windows_s=((back_s, duration_s),)),
        ]
        result = simulate(_spec(tenants, rate, duration_s, seed), policy, fleet, options)
        service = _service(result.trace, back_s, min(duration_s, back_s + 10.0))
        total = sum(service.values())
        share = service.get("returning", 0.0) / total if total else 0.0
        return SuiteResult(
            name,
            policy,
            "returning tenant's share, 10 s after return",
            share,
            "≤ 0.55",
            share <= 0.55,
            service,
        )
    raise ValueError(f"unknown suite {name!r}; choose one of {', '.join(SUITES)}")
