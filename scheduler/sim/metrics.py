"""What a simulation measures, and the numbers computed from it.

The definitions follow the architecture page: TTFT is arrival → first token, TPOT is
(E2E − TTFT) / (output tokens − 1), attainment counts refused requests as misses of the
offered load, goodput is requests per second finishing within their SLO (batch: within
its deadline), fairness is Jain's index over served tokens / weight among tenants of one
tier that stayed backlogged through the measurement window.
"""

from __future__ import annotations

import math
from array import array
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
    # Refused at admission, by code: offered = admitted + refused.
    rejections: dict[str, int]
    # Admitted, then dropped before they ran (queue timeout, too long for the engine), by
    # code: misses of admitted requests, not refusals, so apart from `rejections`.
    dropped: dict[str, int]
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
    # Steady-state throughput: output tokens of the engine steps (and decode runs) that
    # ended by duration_s, over duration_s. The drain's tokens are left out: they would
    # credit a policy for finishing late what it could not serve while load arrived.
    output_tokens_per_s: float
    num_preemptions: int
    num_recomputed_tokens: int
    fairness: dict[str, FairnessStats]
    num_steps: int = 0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return asdict(self)


class Collector:
    """Aggregates request fates as they happen, so that a simulated hour of millions of
    requests keeps only numbers (and, on request, the records themselves)."""

    def __init__(self, *, keep_records: bool = False) -> None:
        self.keep_records = keep_records
        self.records: list[RequestRecord] = []
        self._offered: dict[str, int] = defaultdict(int)
        self._refused: dict[str, int] = defaultdict(int)  # at admission (never queued)
        self._finished: dict[str, int] = defaultdict(int)
        self._met: dict[str, int] = defaultdict(int)
        self._rejections: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._dropped: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._ttft_ms: dict[str, array[float]] = defaultdict(lambda: array("d"))
        self._tpot_ms: dict[str, array[float]] = defaultdict(lambda: array("d"))
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    def offered(self, request: SimRequest) -> None:
        self._offered[request.tier] += 1

    def refused(self, record: RequestRecord, code: str) -> None:
        """Refused at admission (rate limit, SLO unattainable, queue full)."""
        record.rejected_code = code
        self._refused[record.request.tier] += 1
        self._rejections[record.request.tier][code] += 1
        self._keep(record)

    def dropped(self, record: RequestRecord, code: str) -> None:
        """Admitted, then dropped before it ran (queue timeout, refused by the engine)."""
        record.rejected_code = code
        self._dropped[record.request.tier][code] += 1
        self._keep(record)

    def finished(self, record: RequestRecord) -> None:
        tier = record.request.tier
        self._finished[tier] += 1
        if record.met_slo:
            self._met[tier] += 1
        ttft, tpot = record.ttft_s, record.tpot_s
        if ttft is not None:
            self._ttft_ms[tier].append(ttft * 1000)
        if tpot is not None and record.request.num_output_tokens > 1:
            self._tpot_ms[tier].append(tpot * 1000)
        self._keep(record)

    def _keep(self, record: RequestRecord) -> None:
        if self.keep_records:
            self.records.append(record)

    def tiers(self) -> list[str]:
        return sorted(self._offered)

    def tier_stats(self, tier: str, duration_s: float) -> TierStats:
        offered = self._offered[tier]
        admitted = offered - self._refused[tier]
        met = self._met[tier]
        ttfts, tpots = self._ttft_ms[tier], self._tpot_ms[tier]
        return TierStats(
            tier=tier,
            num_offered=offered,
            num_admitted=admitted,
            num_finished=self._finished[tier],
            num_met_slo=met,
            attainment=met / offered if offered else None,
            admitted_attainment=met / admitted if admitted else None,
            goodput_per_s=met / duration_s if duration_s > 0 else 0.0,
            ttft_p50_ms=percentile(ttfts, 50),
            ttft_p99_ms=percentile(ttfts, 99),
            tpot_p50_ms=percentile(tpots, 50),
            tpot_p99_ms=percentile(tpots, 99),
            rejections=dict(self._rejections[tier]),
            dropped=dict(self._dropped[tier]),
            num_unfinished=admitted - self._finished[tier] - sum(self._dropped[tier].values()),
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
