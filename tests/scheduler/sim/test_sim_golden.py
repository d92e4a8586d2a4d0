"""Small simulations whose every request timing is pinned, so that speed-ups of the
simulator (and plain speed-ups of the policy code it drives) provably change nothing.

Each case runs a fixed list of requests (drawn here, not by the workload module, so
that workload changes do not move it) and compares a digest of every request's fate and
of the run's statistics with `golden_runs.json`. A change that is meant to alter what
the simulator computes (a policy change) regenerates the file:

    python -m tests.scheduler.sim.test_sim_golden
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.sim.cost_model import load_preset
from scheduler.sim.fleet import FleetSpec, SimOptions, SimResult, simulate
from scheduler.sim.workload import SimRequest, TenantSpec, TierSpec, WorkloadSpec

GOLDEN = Path(__file__).with_name("golden_runs.json")
H200 = load_preset("h200-llama-3.1-8b")

TIERS = (
    TierSpec("priority", 0, ttft_slo_ms=500, tpot_slo_ms=50, max_queue_ms=2_000),
    TierSpec(
        "interactive", 1, ttft_slo_ms=2_000, tpot_slo_ms=100, min_share=0.1, max_queue_ms=10_000
    ),
    TierSpec("batch", 2, preemptible=True, completion_window_s=600),
)
# (tier, weight, share of arrivals)
TENANTS = (
    ("p0", "priority", 1.0, 0.1),
    ("p1", "priority", 2.0, 0.05),
    ("i0", "interactive", 1.0, 0.2),
    ("i1", "interactive", 3.0, 0.2),
    ("i2", "interactive", 1.0, 0.1),
    ("b0", "batch", 1.0, 0.2),
    ("b1", "batch", 4.0, 0.15),
)
# (prompt, output) lengths per tier: (mean, sigma, high)
LENGTHS = {
    "priority": ((400, 0.6, 4096), (150, 0.6, 1024)),
    "interactive": ((700, 0.7, 6144), (220, 0.6, 1024)),
    "batch": ((1500, 0.8, 8192), (500, 0.7, 2048)),
}


def _lognormal(rng: random.Random, mean: float, sigma: float, high: int) -> int:
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(8, min(high, round(value)))


def _pick_tenant(pick: float) -> tuple[str, str, float]:
    for tenant_id, tier_name, weight, share in TENANTS:
        pick -= share
        if pick <= 0:
            return tenant_id, tier_name, weight
    return TENANTS[-1][:3]


def _requests(rate_per_s: float, duration_s: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    tiers = {t.name: t for t in TIERS}
    total = sum(share for *_, share in TENANTS)
    out = []
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        tenant_id, tier_name, weight = _pick_tenant(rng.random() * total)
        tier = tiers[tier_name]
        (pm, ps, ph), (om, os_, oh) = LENGTHS[tier_name]
        n += 1
        out.append(
            SimRequest(
                request_id=f"r{n}",
                arrival_s=t,
                tenant_id=tenant_id,
                tier=tier_name,
                rank=tier.rank,
                weight=weight,
                num_prompt_tokens=_lognormal(rng, pm, ps, ph),
                num_output_tokens=_lognormal(rng, om, os_, oh),
                ttft_slo_ms=tier.ttft_slo_ms,
                tpot_slo_ms=tier.tpot_slo_ms,
                preemptible=tier.preemptible,
                max_queue_ms=tier.max_queue_ms,
                deadline_s=t + tier.completion_window_s if tier.completion_window_s else None,
            )
        )


def _workload(rate_per_s: float, duration_s: float) -> WorkloadSpec:
    tenants = tuple(TenantSpec(t, tier, w, share) for t, tier, w, share in TENANTS)
    return WorkloadSpec(TIERS, tenants, rate_per_s, duration_s)


def _run(
    policy: str, rate: float, engines: int, seed: int, *, num_kv_blocks: int, **options: object
) -> SimResult:
    duration_s = 8.0
    params = replace(H200, num_kv_blocks=num_kv_blocks, max_num_seqs=48)
    return simulate(
        _workload(rate, duration_s),
        policy,
        FleetSpec(params, engines),
        SimOptions(keep_records=True, drain_s=20.0, rate_limits=False, **options),  # type: ignore[arg-type]
        requests=_requests(rate, duration_s, seed),
    )


# KV pressure (2,500 blocks of 16 tokens for 48 sequences) makes engines preempt; several
# engines make runs compete for queued jobs; charge_interval_s batches queue charges.
CASES: dict[str, Callable[[], SimResult]] = {
    "tiered-fast-fleet": lambda: _run(
        "tiered", 45, 3, 1, num_kv_blocks=2_500, fast_forward=True, charge_interval_s=0.5
    ),
    "tiered-step-fleet": lambda: _run("tiered", 45, 3, 1, num_kv_blocks=2_500),
    "tiered-fast-one": lambda: _run(
        "tiered", 25, 1, 2, num_kv_blocks=3_000, fast_forward=True, sample_interval_s=0.5
    ),
    "priority-fast": lambda: _run("priority", 40, 2, 3, num_kv_blocks=2_500, fast_forward=True),
    "fcfs-fast": lambda: _run("fcfs", 30, 1, 4, num_kv_blocks=48_000, fast_forward=True),
    "vtc-step": lambda: _run("vtc", 30, 1, 4, num_kv_blocks=4_000, charge_interval_s=0.25),
}


def digest(result: SimResult) -> dict[str, object]:
    """Every request's fate (times to the last bit), the run's statistics and the
    fairness trace, hashed; the step and preemption counts in the clear."""
    fates = hashlib.sha256()
    for r in sorted(result.collector.records, key=lambda r: r.request.request_id):
        fates.update(
            repr(
                (
                    r.request.request_id,
                    r.rejected_code,
                    r.dispatch_s,
                    r.first_token_s,
                    r.finish_s,
                    r.num_preemptions,
                )
            ).encode()
        )
    stats = result.stats.to_dict()
    stats.pop("wall_s")
    trace = result.trace
    served = [sorted(s.items()) for s in trace.served]
    backlogged = [sorted(b) for b in trace.backlogged]
    return {
        "requests": fates.hexdigest()[:24],
        "stats": _hash(json.dumps(stats, sort_keys=True, default=repr)),
        "trace": _hash(repr((trace.times_s, served, backlogged))),
        "num_records": len(result.collector.records),
        "num_steps": result.stats.num_steps,
        "num_preemptions": result.stats.num_preemptions,
    }


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulation_matches_its_golden_digest(case: str) -> None:
    expected = json.loads(GOLDEN.read_text())[case]
    got = digest(CASES[case]())
    assert got == expected


def test_golden_cases_exercise_preemption_and_refusals() -> None:
    # The pins are only worth something if the runs take the interesting paths.
    golden = json.loads(GOLDEN.read_text())
    assert golden["tiered-fast-fleet"]["num_preemptions"] > 0
    assert golden["priority-fast"]["num_preemptions"] > 0
    assert golden["tiered-step-fleet"]["num_steps"] > 1_000


def main() -> None:
    GOLDEN.write_text(
        json.dumps({name: digest(run()) for name, run in sorted(CASES.items())}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
