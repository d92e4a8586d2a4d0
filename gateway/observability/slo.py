"""SLO attainment of one request and a rolling window of recent outcomes per tier.

Definitions (ARCHITECTURE.md, "Numbers we report"): a request meets its tier's SLO when
it completed, TTFT <= ttft_slo_ms and TPOT <= tpot_slo_ms (a tier without one of them
does not check it); refused and failed requests count as misses, so attainment is of
the offered load.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SloTargets:
    """A tier's latency targets; None means the tier does not promise that number."""

    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None


INVALID_PREFIX = "invalid:"  # outcome of a request refused for the client's own mistake


def is_invalid(outcome: str) -> bool:
    """Whether a request ended as the client's own mistake (errors.unserved_outcome): it
    stays out of the usage report and of SLO attainment and refusals, since it says
    nothing of the service (usage_records keeps it, /metrics counts it apart)."""
    return outcome.startswith(INVALID_PREFIX)


def is_prompt_served(outcome: str, queue_wait_ms: float | None) -> bool:
    """Whether a request's prompt tokens count as served (usage report, token metrics,
    the tenant's TPM): it was admitted and left the queue. A refused prompt was never
    processed, nor was one whose client went away (or that failed) while still queued."""
    return queue_wait_ms is not None and not outcome.startswith("rejected:")


def billed_tokens(
    outcome: str, queue_wait_ms: float | None, prompt_tokens: int, completion_tokens: int
) -> tuple[int, int]:
    """(input, output) tokens a request is billed for, as the usage report, the token
    metrics and the tenant's TPM refund count them: its prompt once it was admitted and
    left the queue (is_prompt_served), its output unless it was refused (a queue timeout
    of a request whose other choices ran reached nobody)."""
    served_in = prompt_tokens if is_prompt_served(outcome, queue_wait_ms) else 0
    return served_in, 0 if outcome.startswith("rejected:") else completion_tokens


def tpot_ms(e2e_ms: float, ttft_ms: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1). For a
    request with several choices, which decode side by side, the output tokens are its
    longest choice's (UsageRecord.decode_tokens): n choices make n tokens in one token's
    time, and the longest one spans E2E."""
    if ttft_ms is None or num_output_tokens < 2:
        return None
    return max(0.0, e2e_ms - ttft_ms) / (num_output_tokens - 1)


def is_slo_met(
    targets: SloTargets, *, is_ok: bool, ttft_ms: float | None, tpot_ms: float | None
) -> bool:
    """Whether one request met `targets` (a refused or failed request never does)."""
    if not is_ok:
        return False
    if targets.ttft_slo_ms is not None and (ttft_ms is None or ttft_ms > targets.ttft_slo_ms):
        return False
    return not (
        targets.tpot_slo_ms is not None and tpot_ms is not None and tpot_ms > targets.tpot_slo_ms
    )


@dataclass
class _Bucket:
    start_s: float
    requests: Counter[str] = field(default_factory=Counter)  # tier -> requests
    met: Counter[str] = field(default_factory=Counter)  # tier -> requests within SLO
    refusals: Counter[str] = field(default_factory=Counter)  # code -> refusals
    tenant_requests: Counter[str] = field(default_factory=Counter)
    tenant_tokens: Counter[str] = field(default_factory=Counter)


class RecentOutcomes:
    """Outcomes of the last `num_buckets * bucket_s` seconds, in wall-clock buckets.

    Memory is bounded: old buckets fall off, and a bucket holds at most the tenants
    seen during its `bucket_s` seconds. This feeds the dashboard; Prometheus gets the
    cumulative counters instead.
    """

    def __init__(self, *, bucket_s: float = 10.0, num_buckets: int = 60) -> None:
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque(maxlen=num_buckets)

    def _current(self, now_s: float) -> _Bucket:
        start_s = now_s - now_s % self.bucket_s
        if not self._buckets or self._buckets[-1].start_s < start_s:
            self._buckets.append(_Bucket(start_s))
        return self._buckets[-1]

    def add(
        self,
        *,
        tier: str,
        tenant_id: str,
        is_met: bool,
        num_tokens: int,
        refusal_code: str | None,
        is_counted: bool = True,
        now_s: float | None = None,
    ) -> None:
        """One finished request. `is_counted` False (the client went away) leaves it out
        of its tier's attainment, but not out of its tenant's requests and tokens."""
        bucket = self._current(time.time() if now_s is None else now_s)
        if is_counted:
            bucket.requests[tier] += 1
            if is_met:
                bucket.met[tier] += 1
        if refusal_code is not None:
            bucket.refusals[refusal_code] += 1
        bucket.tenant_requests[tenant_id] += 1
        bucket.tenant_tokens[tenant_id] += num_tokens

    def _since(self, window_s: float, now_s: float) -> list[_Bucket]:
        oldest_s = now_s - window_s
        return [b for b in self._buckets if b.start_s + self.bucket_s > oldest_s]

    def attainment(self, window_s: float, now_s: float | None = None) -> dict[str, float]:
        """tier -> share of its requests within SLO over the last `window_s` seconds."""
        requests: Counter[str] = Counter()
        met: Counter[str] = Counter()
        for bucket in self._since(window_s, time.time() if now_s is None else now_s):
            requests.update(bucket.requests)
            met.update(bucket.met)
        return {tier: met[tier] / n for tier, n in requests.items() if n}

    def series(self, window_s: float, now_s: float | None = None) -> list[dict]:
        """One point per bucket: its start and, per tier, requests and requests met."""
        buckets = self._since(window_s, time.time() if now_s is None else now_s)
        return [
            {"t_s": b.start_s, "requests": dict(b.requests), "met": dict(b.met)} for b in buckets
        ]

    def refusals(self, window_s: float, now_s: float | None = None) -> dict[str, int]:
        total: Counter[str] = Counter()
        for bucket in self._since(window_s, time.time() if now_s is None else now_s):
            total.update(bucket.refusals)
        return dict(total)

    def top_tenants(
        self, window_s: float, n: int, now_s: float | None = None
    ) -> list[dict[str, object]]:
        requests: Counter[str] = Counter()
        tokens: Counter[str] = Counter()
        for bucket in self._since(window_s, time.time() if now_s is None else now_s):
            requests.update(bucket.tenant_requests)
            tokens.update(bucket.tenant_tokens)
        return [
            {"tenant_id": tenant_id, "requests": count, "tokens": tokens[tenant_id]}
            for tenant_id, count in requests.most_common(n)
        ]
