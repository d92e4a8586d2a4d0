"""Who is served next: the tier policy and weighted fair share, as pure functions.

No I/O and no clock: every function takes the values it needs (including `now_ms`), so the
in-memory backend, the Redis scripts (which mirror these rules line by line in Lua) and
the simulator all make the same decision from the same state.

The rules, in order:
1. A queued job whose batch deadline is within `deadline_margin_ms` is served first
   (earliest deadline first), whatever its tier.
2. Across tiers: among tiers with queued work, a tier whose share of the tokens served
   over the sliding window is below its `min_share` goes first (best rank among such
   tiers); otherwise the best rank goes first. Ties on rank break by tier name.
3. Within a tier: the backlogged tenant with the smallest virtual token counter (VTC);
   ties break by tenant id. Counters grow by weighted tokens divided by the tenant's
   current weight (that of its latest job, or a later change), whichever job they were
   served to; a tenant returning from idle is lifted to the smallest backlogged counter.
4. Within a tenant: arrival order.

Queued jobs older than their `max_queue_ms` are dropped (`queue_timeout`) before a pick.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.job import Job

# Tier names appear inside Redis key names, so they are kept to a safe alphabet.
TIER_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
# A tier with queued jobs but no configuration (deleted at runtime) is served last.
UNCONFIGURED_TIER_RANK = 2**31


class PolicyConfigError(ValueError):
    """A tier or policy setting outside its valid range."""


@dataclass(frozen=True)
class TierConfig:
    """What the queue needs to know about a tier (the rest of the tier row lives in SQL)."""

    name: str
    rank: int
    min_share: float = 0.0  # fraction of served tokens kept even when better ranks are busy
    ttft_slo_ms: float | None = None  # admission predicts TTFT against it; None = no SLO
    max_queued_jobs: int | None = None  # enqueue refuses with queue_full past this

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TIER_NAME_PATTERN.match(self.name):
            raise PolicyConfigError(
                f"tier name {self.name!r} must match {TIER_NAME_PATTERN.pattern}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise PolicyConfigError(f"tier {self.name}: rank must be an integer >= 0")
        if not _is_number(self.min_share) or not 0.0 <= self.min_share <= 1.0:
            raise PolicyConfigError(f"tier {self.name}: min_share must be in [0, 1]")
        if self.ttft_slo_ms is not None and (
            not _is_number(self.ttft_slo_ms) or self.ttft_slo_ms <= 0
        ):
            raise PolicyConfigError(f"tier {self.name}: ttft_slo_ms must be > 0")
        if self.max_queued_jobs is not None and (
            isinstance(self.max_queued_jobs, bool)
            or not isinstance(self.max_queued_jobs, int)
            or self.max_queued_jobs < 1
        ):
            raise PolicyConfigError(f"tier {self.name}: max_queued_jobs must be an integer >= 1")


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the policy, identical in every process that shares a queue."""

    input_token_weight: float = 1.0
    output_token_weight: float = 2.0  # decoding a token costs about twice a prefill token
    share_window_ms: int = 60_000  # the sliding window of min_share
    share_buckets: int = 12  # the window is kept as this many fixed buckets
    deadline_margin_ms: int = 600_000  # batch work this close to its deadline is promoted
    max_expired_per_dispatch: int = 64  # bounds the work one dispatch spends on timeouts

    def __post_init__(self) -> None:
        for name in ("input_token_weight", "output_token_weight"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise PolicyConfigError(f"{name} must be > 0")
        if self.share_buckets < 1 or self.share_window_ms < self.share_buckets:
            raise PolicyConfigError("share_window_ms must hold at least one ms per bucket")
        if self.deadline_margin_ms < 0 or self.max_expired_per_dispatch < 1:
            raise PolicyConfigError("deadline_margin_ms >= 0 and max_expired_per_dispatch >= 1")

    @property
    def share_bucket_ms(self) -> int:
        return self.share_window_ms // self.share_buckets


@dataclass(frozen=True)
class TierLoad:
    """One backlogged tier as the cross-tier rule sees it."""

    name: str
    rank: int
    min_share: float
    window_tokens: int  # tokens served to this tier inside the sliding window


def charge_cost(
    num_input_tokens: int, num_output_tokens: int, weight: float, config: PolicyConfig
) -> float:
    """How much a tenant's virtual counter grows for tokens served.

    The Lua scripts evaluate the same expression in the same order, so both backends
    produce bit-identical counters.
    """
    return (
        config.input_token_weight * num_input_tokens
        + config.output_token_weight * num_output_tokens
    ) / weight


def lifted_counter(own: float, min_backlogged: float | None, floor: float) -> float:
    """The counter of a tenant that becomes backlogged: never below the smallest backlogged
    counter (or, with nobody backlogged, the counter last served), so idling banks no credit."""
    return max(own, floor if min_backlogged is None else min_backlogged)


def share_bucket(now_ms: int, config: PolicyConfig) -> int:
    return now_ms // config.share_bucket_ms


def is_bucket_in_window(bucket: int, now_ms: int, config: PolicyConfig) -> bool:
    return bucket > share_bucket(now_ms, config) - config.share_buckets


def window_sum(buckets: Mapping[int, int], now_ms: int, config: PolicyConfig) -> int:
    return sum(n for b, n in buckets.items() if is_bucket_in_window(b, now_ms, config))


def choose_tier(backlogged: Iterable[TierLoad], total_window_tokens: int) -> str | None:
    """The tier to serve next among those with queued work, or None if there is none."""
    loads = list(backlogged)
    starved = [
        t
        for t in loads
        if t.min_share > 0
        and total_window_tokens > 0
        and t.window_tokens < t.min_share * total_window_tokens
    ]
    pool = starved or loads
    if not pool:
        return None
    return min(pool, key=lambda t: (t.rank, t.name)).name


def is_deadline_at_risk(deadline_ms: int, now_ms: int, config: PolicyConfig) -> bool:
    return deadline_ms - now_ms <= config.deadline_margin_ms


def expire_at_ms(job: Job) -> int | None:
    """When a queued job is dropped with queue_timeout (None: never)."""
    if job.max_queue_ms is None:
        return None
    return math.floor(job.arrival_s * 1000 + job.max_queue_ms)


def deadline_ms(job: Job) -> int | None:
    return None if job.deadline_s is None else math.floor(job.deadline_s * 1000)


def tier_order(tiers: Sequence[TierConfig]) -> list[TierConfig]:
    """Tiers best first (rank, then name)."""
    return sorted(tiers, key=lambda t: (t.rank, t.name))


def validate_tiers(tiers: Sequence[TierConfig]) -> None:
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise PolicyConfigError(f"duplicate tier names in {names}")


def validate_weight(weight: float) -> None:
    """A tenant's fair-share weight: a finite number > 0, since charges divide by it."""
    if not _is_number(weight) or weight <= 0:
        raise PolicyConfigError(f"a fair-share weight must be a finite number > 0, not {weight!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
