"""Synthetic workloads: who sends what, when.

A workload is tiers (SLOs and length distributions), tenants (tier, weight, share of the
load, on/off windows) and an arrival process (Poisson or gamma, plus surges). `generate`
turns it into a sorted list of `SimRequest`, deterministic for a seed, so two policies see
exactly the same arrivals.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from scheduler.rate_limit import TenantLimits


class WorkloadError(ValueError):
    """A workload that cannot be generated (negative rate, empty tenant list...)."""


# The longest length a distribution may draw. No simulated context comes near it (the
# default is 16,384 tokens; a longer request is dropped as invalid_request), and the
# simulator builds each prompt as a list of token ids: 10^9 tokens took minutes and
# gigabytes before the engine could refuse it.
MAX_LENGTH_TOKENS = 2**20
# The largest gamma gap CV: past it most gamma draws underflow to gaps of exactly 0 s
# (16% at a CV of 20, 93% at 100; 0.05% at 10), so the stream is no longer the process
# asked for, and at 10^6 it never advances.
MAX_BURSTINESS_CV = 10.0
# The admin API's bound on a min_share sum, with its slack for rounding.
_MIN_SHARE_SUM_SLACK = 1e-9


def _is_number(value: object) -> bool:
    """A finite int or float, not a bool (True would read as 1)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: object) -> bool:
    return type(value) is int


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: `fixed`, `uniform` on [low, high], or `lognormal` with the given
    mean and sigma (of the log), clipped to [low, high]."""

    kind: str = "fixed"
    mean: float = 128.0
    sigma: float = 0.5
    low: int = 1
    high: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise WorkloadError(f"length kind must be fixed, uniform or lognormal: {self.kind!r}")
        if not (_is_whole(self.low) and _is_whole(self.high)):
            raise WorkloadError("lengths need whole numbers for low and high")
        if self.low < 1 or self.high < self.low:
            raise WorkloadError("lengths need 1 <= low <= high")
        if self.high > MAX_LENGTH_TOKENS:
            raise WorkloadError(
                f"lengths need high <= {MAX_LENGTH_TOKENS:,} tokens (no simulated context "
                "holds more)"
            )
        # NaN passes every comparison: it failed later, inside round().
        if not _is_number(self.mean) or self.mean < 1:
            raise WorkloadError("lengths need a finite mean >= 1")
        if not _is_number(self.sigma) or self.sigma < 0:
            raise WorkloadError("lengths need a finite sigma >= 0")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        else:
            # mu chosen so that the (unclipped) mean is `mean`.
            mu = math.log(self.mean) - self.sigma * self.sigma / 2
            value = rng.lognormvariate(mu, self.sigma)
        return max(self.low, min(self.high, round(value)))

    @property
    def mean_tokens(self) -> float:
        """The mean length (before clipping), for sizing quotas."""
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return self.mean


@dataclass(frozen=True)
class TierSpec:
    """A tier as the queue and the engine see it (mirrors the tier row)."""

    name: str
    rank: int
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    min_share: float = 0.0
    preemptible: bool = False
    max_queue_ms: float | None = None
    completion_window_s: float | None = None
    max_queued_jobs: int | None = None  # the queue refuses (queue_full) past this
    prompt_len: LengthDist = field(default_factory=LengthDist)
    output_len: LengthDist = field(default_factory=LengthDist)
    # Per-tenant defaults of the tier row (rpm, tpm, max_concurrency); unlimited if unset.
    limits: TenantLimits = field(default_factory=TenantLimits)
    # The max_tokens clients ask. None: each asks exactly its output length and runs to
    # it (ignore_eos), so the queue and admission know every length. Set: requests ask
    # this many and stop early at their drawn length (an end of sequence), as chat
    # clients do; a drawn length above it is cut there.
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        # The admin API's bounds on a tier row (gateway/admin/validation.py), so that a
        # simulated tier is one an operator could create.
        def fail(what: str) -> WorkloadError:
            return WorkloadError(f"tier {self.name}: {what}")

        if not _is_whole(self.rank) or self.rank < 0:
            raise fail("rank must be a whole number >= 0")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "max_queue_ms", "completion_window_s"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value <= 0):
                raise fail(f"{name} must be a finite number > 0 (or None)")
        if not _is_number(self.min_share) or not 0 <= self.min_share < 1:
            raise fail("min_share must be in [0, 1)")
        if self.max_queued_jobs is not None and (
            not _is_whole(self.max_queued_jobs) or self.max_queued_jobs < 1
        ):
            raise fail("max_queued_jobs must be a whole number >= 1 (or None)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise fail("max_tokens must be >= 1")

    @property
    def has_latency_slo(self) -> bool:
        return self.ttft_slo_ms is not None or self.tpot_slo_ms is not None


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: its tier, fair-share weight and share of the offered load.

    on_windows_s: (start, end) intervals in which it sends; empty means always.
    limits: the tenant's overrides of its tier's rpm, tpm and max_concurrency; a field
    left None keeps the tier's default (as the gateway resolves a tenant's limits).
    """

    tenant_id: str
    tier: str
    weight: float = 1.0
    load_share: float = 1.0
    on_windows_s: tuple[tuple[float, float], ...] = ()
    limits: TenantLimits | None = None

    def is_on(self, t_s: float) -> bool:
        if not self.on_windows_s:
            return True
        return any(start <= t_s < end for start, end in self.on_windows_s)

    def effective_limits(self, tier: TierSpec) -> TenantLimits:
        """Its own limit where it has one, else its tier's default."""
        own, base = self.limits, tier.limits
        if own is None:
            return base
        return TenantLimits(
            rpm=own.rpm if own.rpm is not None else base.rpm,
            tpm=own.tpm if own.tpm is not None else base.tpm,
            max_concurrency=(
                own.max_concurrency if own.max_concurrency is not None else base.max_concurrency
            ),
        )


@dataclass(frozen=True)
class Surge:
    """The offered rate is multiplied by `multiplier` in [start_s, start_s + duration_s);
    where surges overlap, their multipliers multiply."""

    start_s: float
    duration_s: float
    multiplier: float


@dataclass(frozen=True)
class WorkloadSpec:
    tiers: tuple[TierSpec, ...]
    tenants: tuple[TenantSpec, ...]
    rate_per_s: float
    duration_s: float
    arrival: str = "poisson"  # or "gamma"
    burstiness_cv: float = 1.0  # coefficient of variation of gamma gaps; 1 is Poisson
    surges: tuple[Surge, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tiers or not self.tenants:
            raise WorkloadError("a workload needs at least one tier and one tenant")
        if not math.isfinite(self.rate_per_s) or self.rate_per_s < 0:
            raise WorkloadError("rate_per_s must be a finite number >= 0")
        if not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise WorkloadError("duration_s must be > 0")
        if self.arrival not in ("poisson", "gamma"):
            raise WorkloadError(f"arrival must be poisson or gamma: {self.arrival!r}")
        if not _is_number(self.burstiness_cv) or not 0 < self.burstiness_cv <= MAX_BURSTINESS_CV:
            raise WorkloadError(f"burstiness_cv must be in (0, {MAX_BURSTINESS_CV:g}]")
        names = [t.name for t in self.tiers]
        _refuse_repeats("tier", names)
        _refuse_repeats("tenant", [t.tenant_id for t in self.tenants])
        min_shares = sum(t.min_share for t in self.tiers)
        if min_shares > 1 + _MIN_SHARE_SUM_SLACK:
            # As the admin API refuses it: the tiers cannot all be kept their shares.
            raise WorkloadError(f"min_share over all tiers is {min_shares:g}; it may not exceed 1")
        for tenant in self.tenants:
            if tenant.tier not in names:
                raise WorkloadError(f"tenant {tenant.tenant_id} has unknown tier {tenant.tier}")
            # The queue divides charges by the weight (scheduler.policy.validate_weight).
            if not _is_number(tenant.weight) or tenant.weight <= 0:
                raise WorkloadError(
                    f"tenant {tenant.tenant_id}: weight must be a finite number > 0"
                )
            if not _is_number(tenant.load_share) or tenant.load_share < 0:
                raise WorkloadError(
                    f"tenant {tenant.tenant_id}: load_share must be a finite number >= 0"
                )
        if sum(t.load_share for t in self.tenants) <= 0:
            raise WorkloadError("the tenants' load shares sum to zero")
        peak = 1.0
        for surge in self.surges:
            numbers = (surge.start_s, surge.duration_s, surge.multiplier)
            if not all(_is_number(x) for x in numbers):
                raise WorkloadError(f"a surge needs finite numbers: {surge}")
            if surge.multiplier < 0 or surge.duration_s < 0:
                raise WorkloadError("a surge needs multiplier >= 0 and duration_s >= 0")
            peak *= max(1.0, surge.multiplier)
        if not math.isfinite(peak):
            # Overlapping, they would multiply the rate past what a float holds.
            raise WorkloadError("the surges' multipliers multiply to more than a float holds")

    def tier(self, name: str) -> TierSpec:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    def with_rate(self, rate_per_s: float) -> WorkloadSpec:
        return replace(self, rate_per_s=rate_per_s)


def _refuse_repeats(kind: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            # Two tenants of one id would be one tenant to the queue and the limiter.
            raise WorkloadError(f"{kind} {name!r} is named twice")
        seen.add(name)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One arrival: everything the queue and the engine need, with lengths drawn."""

    request_id: str
    arrival_s: float
    tenant_id: str
    tier: str
    rank: int
    weight: float
    num_prompt_tokens: int
    num_output_tokens: int  # generated, then it stops (its end, or its max_tokens)
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    preemptible: bool
    max_queue_ms: float | None = None
    deadline_s: float | None = None
    # What its client asked (TierSpec.max_tokens); None: exactly num_output_tokens, and
    # it cannot stop earlier (ignore_eos).
    max_tokens: int | None = None

    @property
    def asked_tokens(self) -> int:
        """Its max_tokens: what the queue, admission and rate limits count for it."""
        return self.num_output_tokens if self.max_tokens is None else self.max_tokens


class _SurgeClock:
    """Maps operational time to real time through the surges.

    Operational time runs at the base rate everywhere: a stretch where the surges
    multiply the rate by m takes m times as much of it per real second. The cumulative
    multiplier M(t) = integral of m over [0, t] is piecewise linear (the surges make m
    piecewise constant), so a renewal process drawn at the base rate in operational time
    and mapped through M^-1 has rate base x m(t) exactly, and within each stretch its
    gaps are the drawn ones scaled by 1/m, so a gamma process keeps its CV. Thinning a
    stream drawn at a peak rate did neither: overlapping surges were capped at the
    largest single multiplier, and thinning pushed gamma gaps towards Poisson.
    """

    def __init__(self, surges: tuple[Surge, ...]) -> None:
        edges = sorted(
            {0.0, *(s.start_s for s in surges), *(s.start_s + s.duration_s for s in surges)}
        )
        edges = [t for t in edges if t >= 0.0]
        # Stretch i is [starts[i], starts[i+1]) in real time with multiplier rates[i],
        # beginning at operational time marks[i]; the last one runs on at multiplier 1.
        self.starts: list[float] = []
        self.rates: list[float] = []
        self.marks: list[float] = []
        mark = 0.0
        for i, start_s in enumerate(edges):
            m = 1.0
            for surge in surges:
                if surge.start_s <= start_s < surge.start_s + surge.duration_s:
                    m *= surge.multiplier
            self.starts.append(start_s)
            self.rates.append(m)
            self.marks.append(mark)
            if i + 1 < len(edges):
                mark += m * (edges[i + 1] - start_s)
        self._index = 0  # operational times come in increasing order: walk forward

    def real_s(self, op_s: float) -> float:
        """The real time at operational time `op_s` (calls in increasing order)."""
        if len(self.starts) == 1:
            return op_s  # no surge: the identity, exactly (the same arrivals as before)
        i = self._index
        while i + 1 < len(self.starts) and (
            self.marks[i + 1] < op_s or (self.marks[i + 1] == op_s and self.rates[i] == 0)
        ):
            i += 1
        self._index = i
        # A stretch of multiplier 0 takes no operational time: it is stepped over above.
        return self.starts[i] + (op_s - self.marks[i]) / self.rates[i]


def _tenant_stream(spec: WorkloadSpec, tenant: TenantSpec, tier: TierSpec) -> Iterator[SimRequest]:
    total_share = sum(t.load_share for t in spec.tenants)
    rate = spec.rate_per_s * tenant.load_share / total_share
    if rate <= 0:
        return
    rng = random.Random(f"{spec.seed}:{tenant.tenant_id}")
    clock = _SurgeClock(spec.surges)
    cv = spec.burstiness_cv if spec.arrival == "gamma" else 1.0
    shape = 1.0 / (cv * cv)
    op_s = 0.0  # operational time: seconds at the base rate (see _SurgeClock)
    n = 0
    while True:
        if cv == 1.0:
            op_s += rng.expovariate(rate)
        else:
            op_s += rng.gammavariate(shape, 1.0 / (shape * rate))
        t = clock.real_s(op_s)
        if t >= spec.duration_s:
            return
        if not tenant.is_on(t):
            continue
        n += 1
        yield SimRequest(
            request_id=f"{tenant.tenant_id}-{n}",
            arrival_s=t,
            tenant_id=tenant.tenant_id,
            tier=tier.name,
            rank=tier.rank,
            weight=tenant.weight,
            num_prompt_tokens=tier.prompt_len.sample(rng),
            num_output_tokens=(
                tier.output_len.sample(rng)
                if tier.max_tokens is None
                else min(tier.output_len.sample(rng), tier.max_tokens)
            ),
            ttft_slo_ms=tier.ttft_slo_ms,
            tpot_slo_ms=tier.tpot_slo_ms,
            preemptible=tier.preemptible,
            max_queue_ms=tier.max_queue_ms,
            deadline_s=t + tier.completion_window_s if tier.completion_window_s else None,
            max_tokens=tier.max_tokens,
        )


def iter_requests(spec: WorkloadSpec) -> Iterator[SimRequest]:
    """All arrivals of the workload in time order, drawn lazily (an hour at 1,000
    requests/s need not sit in memory).

    Each tenant has its own arrival stream (rate = total × its share) so that on/off
    windows and surges change it without shifting anyone else's arrivals. Surges stretch
    the stream's time (see _SurgeClock); an on/off window drops the arrivals outside it.
    """
    tiers = {t.name: t for t in spec.tiers}
    streams = [_tenant_stream(spec, tenant, tiers[tenant.tier]) for tenant in spec.tenants]
    return heapq.merge(*streams, key=lambda r: (r.arrival_s, r.request_id))


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    """All arrivals of the workload, sorted by time (see iter_requests)."""
    return list(iter_requests(spec))


# ---- the standard mixes ----------------------------------------------------------------


# The seeded tiers' per-tenant defaults (migrations/versions/0002_seed_tiers.py).
SEEDED_LIMITS = {
    "priority": TenantLimits(rpm=600, tpm=400_000, max_concurrency=32),
    "interactive": TenantLimits(rpm=300, tpm=200_000, max_concurrency=16),
    "batch": TenantLimits(rpm=None, tpm=2_000_000, max_concurrency=64),
}


def three_tier_tiers(
    *,
    priority_ttft_ms: float = 500.0,
    priority_tpot_ms: float = 50.0,
    interactive_ttft_ms: float = 2000.0,
    interactive_tpot_ms: float = 100.0,
    rate_limits: bool = True,
) -> tuple[TierSpec, ...]:
    """The seeded tiers with chat-like lengths for the latency tiers and long batch jobs,
    with the seeded per-tenant limits (none with rate_limits=False)."""
    tiers = (
        TierSpec(
            "priority",
            0,
            ttft_slo_ms=priority_ttft_ms,
            tpot_slo_ms=priority_tpot_ms,
            min_share=0.0,
            preemptible=False,
            max_queue_ms=2_000,
            prompt_len=LengthDist("lognormal", mean=512, sigma=0.6, low=16, high=4096),
            output_len=LengthDist("lognormal", mean=192, sigma=0.6, low=8, high=1024),
        ),
        TierSpec(
            "interactive",
            1,
            ttft_slo_ms=interactive_ttft_ms,
            tpot_slo_ms=interactive_tpot_ms,
            min_share=0.1,
            preemptible=False,
            max_queue_ms=10_000,
            prompt_len=LengthDist("lognormal", mean=768, sigma=0.7, low=16, high=6144),
            output_len=LengthDist("lognormal", mean=256, sigma=0.6, low=8, high=1024),
        ),
        TierSpec(
            "batch",
            2,
            min_share=0.05,
            preemptible=True,
            completion_window_s=24 * 3600,
            prompt_len=LengthDist("lognormal", mean=1024, sigma=0.5, low=64, high=6144),
            output_len=LengthDist("lognormal", mean=384, sigma=0.5, low=16, high=1536),
        ),
    )
    if not rate_limits:
        return tiers
    return tuple(replace(t, limits=SEEDED_LIMITS[t.name]) for t in tiers)


def provisioned_limits(tier: TierSpec, rate_per_s: float, headroom: float) -> TenantLimits:
    """The limits an operator gives a tenant expected to send `rate_per_s` requests of
    this tier: `headroom` times what that traffic needs, never below the tier's defaults
    (a limit the tier leaves unset stays unset).

    Requests and tokens (prompt + max_tokens) per minute scale with the rate. Concurrency,
    for a tier with latency SLOs, is Little's law at the latency of a request served at
    the edge of its SLO (TTFT SLO + TPOT SLO × mean output). A tier without a latency
    SLO keeps its default concurrency: there the cap bounds how much work one tenant may
    have outstanding, not what its traffic needs.
    """
    if headroom <= 0 or rate_per_s < 0:
        raise WorkloadError("quotas need headroom > 0 and rate_per_s >= 0")
    base = tier.limits
    per_min = headroom * 60.0 * rate_per_s
    tokens = tier.prompt_len.mean_tokens + tier.output_len.mean_tokens

    def at_least(default: int | None, need: float) -> int | None:
        return None if default is None else max(default, math.ceil(need))

    concurrency = base.max_concurrency
    if tier.has_latency_slo:
        edge_s = (tier.ttft_slo_ms or 0.0) / 1000
        edge_s += (tier.tpot_slo_ms or 0.0) / 1000 * tier.output_len.mean_tokens
        concurrency = at_least(concurrency, headroom * rate_per_s * edge_s)
    return TenantLimits(
        rpm=at_least(base.rpm, per_min),
        tpm=at_least(base.tpm, per_min * tokens),
        max_concurrency=concurrency,
    )


def three_tier_mix(
    rate_per_s: float,
    duration_s: float,
    *,
    num_tenants_per_tier: tuple[int, int, int] = (2, 6, 4),
    tier_load_shares: tuple[float, float, float] = (0.15, 0.5, 0.35),
    seed: int = 0,
    arrival: str = "poisson",
    burstiness_cv: float = 1.0,
    surges: tuple[Surge, ...] = (),
    tiers: tuple[TierSpec, ...] | None = None,
    provisioned_rate_per_s: float | None = None,
    quota_headroom: float = 2.0,
    max_tokens: int | None = None,
) -> WorkloadSpec:
    """priority / interactive / batch with several tenants each, equal weights inside a
    tier and the tier's load spread evenly over its tenants.

    Each tenant's limits are provisioned (see provisioned_limits) for its share of
    `provisioned_rate_per_s` (default: `rate_per_s`) with `quota_headroom`: a fleet
    provisioned for 1.0x gives its tenants quotas for their 1.0x traffic, and a load
    sweep keeps those quotas while the offered rate grows.

    `max_tokens`: what every tier's clients ask (TierSpec.max_tokens): requests then
    stop early at their drawn lengths, unknown to the queue and admission in advance.
    """
    tiers = tiers or three_tier_tiers()
    if max_tokens is not None:
        tiers = tuple(replace(t, max_tokens=max_tokens) for t in tiers)
    provisioned = rate_per_s if provisioned_rate_per_s is None else provisioned_rate_per_s
    tenants = []
    for tier, count, share in zip(tiers, num_tenants_per_tier, tier_load_shares, strict=True):
        for i in range(count):
            limits = provisioned_limits(tier, provisioned * share / count, quota_headroom)
            tenants.append(
                TenantSpec(f"{tier.name}-{i}", tier.name, 1.0, share / count, (), limits)
            )
    return WorkloadSpec(
        tiers=tiers,
        tenants=tuple(tenants),
        rate_per_s=rate_per_s,
        duration_s=duration_s,
        arrival=arrival,
        burstiness_cv=burstiness_cv,
        surges=surges,
        seed=seed,
    )


def many_tenants_mix(
    rate_per_s: float, duration_s: float, num_tenants: int, *, seed: int = 0
) -> WorkloadSpec:
    """`num_tenants` spread over the three tiers (10% / 50% / 40%), Zipf-like load shares
    so that a few tenants are heavy and most are light, weights 1 to 4. No rate limits:
    this mix measures the simulator's speed at scale."""
    tiers = three_tier_tiers(rate_limits=False)
    rng = random.Random(seed)
    tenants = []
    for i in range(num_tenants):
        u = i / num_tenants
        tier = tiers[0] if u < 0.1 else tiers[1] if u < 0.6 else tiers[2]
        share = 1.0 / (1 + (i * 7919) % num_tenants) ** 0.8
        tenants.append(TenantSpec(f"t{i}", tier.name, float(rng.randint(1, 4)), share))
    return WorkloadSpec(tiers, tuple(tenants), rate_per_s, duration_s, seed=seed)
