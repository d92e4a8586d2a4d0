"""What a simulation measures, and the numbers computed from it.

The definitions follow the architecture page: TTFT is arrival → first token, TPOT is
(E2E − TTFT) / (output tokens − 1), attainment counts refused requests as misses of the
offered load, goodput is requests per second finishing within their SLO (batch: within
its deadline), fairness is Jain's index over served tokens / weight among tenants of one
tier that stayed backlogged through the measurement window.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduler.sim.workload import SimRequest


@dataclass
class RequestRecord:
    """The fate of one request in the simulation (times on the virtual clock)."""

    request: SimRequest
    dispatch_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected_code: str | None = None  # rate_limited, slo_unattainable, queue_timeout...
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        if self.request.num_output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.request.num_output_tokens - 1)

    @property
    def met_slo(self) -> bool:
        """Finished, within TTFT and TPOT SLOs (and within its deadline, if it has one)."""
        if not self.is_finished:
            return False
        req = self.request
        ttft, tpot = self.ttft_s, self.tpot_s
        if req.ttft_slo_ms is not None and ttft is not None and ttft * 1000 > req.ttft_slo_ms:
            return False
        if req.tpot_slo_ms is not None and tpot is not None and tpot * 1000 > req.tpot_slo_ms:
            return False
        return not (req.deadline_s is not None and self.finish_s > req.deadline_s)  # type: ignore[operator]


@dataclass
class ServiceTrace:
    """Cumulative served tokens per tenant and who was backlogged, sampled periodically."""

    times_s: list[float] = field(default_factory=list)
    served: list[dict[str, float]] = field(default_factory=list)
    backlogged: list[frozenset[str]] = field(default_factory=list)

    def sample(self, t_s: float, served: dict[str, float], backlogged: Iterable[str]) -> None:
        self.times_s.append(t_s)
        self.served.append(dict(served))
        self.backlogged.append(frozenset(backlogged))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def jain_index(values: Sequence[float]) -> float | None:
    """(Σx)² / (n·Σx²): 1 when all are equal, 1/n when one gets everything."""
    if not values:
        return None
    sq = sum(v * v for v in values)
    if sq == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * sq)


@dataclass(frozen=True)
class TierStats:
    tier: str
    num_offered: int
    num_admitted: int
    num_finished: int
    num_met_slo: int
    attainment: float | None  # met / offered (refusals count as misses)
    admitted_attainment: float | None  # met / admitted
    goodput_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    rejections: dict[str, int]
    num_unfinished: int  # admitted but still queued or running at the end


@dataclass(frozen=True)
class FairnessStats:
    tier: str
    tenants: tuple[str, ...]  # backlogged through the whole window
    weighted_service: dict[str, float]  # tokens / weight in the window
    jain_index: float | None
    max_gap_tokens: float  # largest weighted service gap between two of them


@dataclass(frozen=True)
class RunStats:
    duration_s: float
    tiers: dict[str, TierStats]
    output_tokens_per_s: float
    num_preemptions: int
    num_recomputed_tokens: int
    fairness: dict[str, FairnessStats]
    num_steps: int = 0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return asdict(self)


def tier_stats(records: Sequence[RequestRecord], tier: str, duration_s: float) -> TierStats:
    mine = [r for r in records if r.request.tier == tier]
    admitted = [r for r in mine if r.rejected_code is None or r.rejected_code == "queue_timeout"]
    finished = [r for r in mine if r.is_finished]
    met = [r for r in finished if r.met_slo]
    rejections: dict[str, int] = defaultdict(int)
    for r in mine:
        if r.rejected_code is not None:
            rejections[r.rejected_code] += 1
    ttfts = [r.ttft_s * 1000 for r in finished if r.ttft_s is not None]
    tpots = [r.tpot_s * 1000 for r in finished if r.tpot_s is not None]
    return TierStats(
        tier=tier,
        num_offered=len(mine),
        num_admitted=len(admitted),
        num_finished=len(finished),
        num_met_slo=len(met),
        attainment=len(met) / len(mine) if mine else None,
        admitted_attainment=len(met) / len(admitted) if admitted else None,
        goodput_per_s=len(met) / duration_s if duration_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        rejections=dict(rejections),
        num_unfinished=sum(1 for r in admitted if not r.is_finished and r.rejected_code is None),
    )


def fairness_stats(
    trace: ServiceTrace,
    tenant_tier: dict[str, str],
    tenant_weight: dict[str, float],
    window_s: tuple[float, float],
) -> dict[str, FairnessStats]:
    """Per tier: service in the window of the tenants backlogged at every sample in it."""
    idx = [i for i, t in enumerate(trace.times_s) if window_s[0] <= t <= window_s[1]]
    out: dict[str, FairnessStats] = {}
    if len(idx) < 2:
        return out
    always = frozenset.intersection(*(trace.backlogged[i] for i in idx))
    first = trace.served[idx[0]]
    for tier in sorted(set(tenant_tier.values())):
        tenants = tuple(sorted(t for t in always if tenant_tier.get(t) == tier))
        if len(tenants) < 2:
            continue
        gap = 0.0
        for i in idx:
            now = trace.served[i]
            w = [(now.get(t, 0.0) - first.get(t, 0.0)) / tenant_weight[t] for t in tenants]
            gap = max(gap, max(w) - min(w))
        last = trace.served[idx[-1]]
        weighted = {t: (last.get(t, 0.0) - first.get(t, 0.0)) / tenant_weight[t] for t in tenants}
        out[tier] = FairnessStats(
            tier=tier,
            tenants=tenants,
            weighted_service=weighted,
            jain_index=jain_index(list(weighted.values())),
            max_gap_tokens=gap,
        )
    return out
