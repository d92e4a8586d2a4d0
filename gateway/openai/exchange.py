"""One admitted request's accounting: its choices' streams and token counts, its
timeline for telemetry, and the UsageRecord it leaves when it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.auth import Principal
from gateway.observability import RequestTimeline
from gateway.observability.slo import SloTargets
from gateway.openai.choices import choice_counts, first_queue_wait_ms
from gateway.tiers import TierPolicy
from gateway.usage import TokenPrices, UsageRecord
from scheduler.rate_limit import Reservation
from scheduler.results import JobStream


@dataclass
class Exchange:
    """One admitted request's accounting, turned into a UsageRecord at the end."""

    request_id: str
    principal: Principal
    tier: str
    model: str
    started_s: float  # monotonic
    num_prompt_tokens: int = 0
    # Each choice's output tokens so far; a request has one choice per job.
    choice_tokens: list[int] = field(default_factory=lambda: [0])
    first_token_s: float | None = None
    streams: list[JobStream] = field(default_factory=list)  # one per choice
    # The exchange is created right after authentication, so this marks its end.
    authenticated_s: float = field(default_factory=time.monotonic)
    last_token_s: float | None = None
    is_stream: bool = False
    stream_began: bool = False  # the server started its SSE body
    reservation: Reservation | None = None
    slo: SloTargets | None = None  # the SLO of the tier it runs at, once that is known
    prices: TokenPrices | None = None  # and that tier's prices

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.choice_tokens)

    @property
    def job_ids(self) -> list[str]:
        return [stream.job.job_id for stream in self.streams]

    def _dispatched_s(self) -> float | None:
        # The request's work began when its first choice left the queue.
        started = [s.dispatched_s for s in self.streams if s.dispatched_s is not None]
        return min(started, default=None)

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(
            started_s=self.started_s,
            authenticated_s=self.authenticated_s,
            enqueued_s=self.streams[0].enqueued_s if self.streams else None,
            dispatched_s=self._dispatched_s(),
            first_token_s=self.first_token_s,
            last_token_s=self.last_token_s,
            finished_s=time.monotonic(),
            is_stream=self.is_stream,
        )

    def record(self, outcome: str) -> UsageRecord:
        return usage_record(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            tier=self.tier,
            model=self.model,
            started_s=self.started_s,
            first_token_s=self.first_token_s,
            prompt_tokens=self.num_prompt_tokens,
            choice_tokens=self.choice_tokens,
            queue_wait_ms=first_queue_wait_ms(self.streams),
            outcome=outcome,
            slo=self.slo,
            prices=self.prices,
            job_ids=tuple(self.job_ids),
        )


def usage_record(
    *,
    request_id: str,
    tenant_id: str,
    tier: str,
    model: str,
    started_s: float,
    first_token_s: float | None,
    prompt_tokens: int,
    choice_tokens: list[int],
    queue_wait_ms: float | None,
    outcome: str,
    slo: SloTargets | None,
    prices: TokenPrices | None,
    job_ids: tuple[str, ...] = (),
) -> UsageRecord:
    """The UsageRecord of a request (live, or a batch line) ending now; times are
    monotonic seconds, `slo` and `prices` those of the tier it ran at."""
    now = time.monotonic()
    ttft_ms = None if first_token_s is None else (first_token_s - started_s) * 1000.0
    return UsageRecord(
        request_id=request_id,
        tenant_id=tenant_id,
        tier=tier,
        model=model,
        prompt_tokens=prompt_tokens,
        queue_wait_ms=queue_wait_ms,
        ttft_ms=ttft_ms,
        e2e_ms=(now - started_s) * 1000.0,
        outcome=outcome,
        created_at=datetime.now(UTC),
        slo=slo,
        prices=prices,
        job_ids=job_ids,
        **choice_counts(choice_tokens),
    )


def tier_slo(tier: TierPolicy) -> SloTargets:
    return SloTargets(tier.ttft_slo_ms, tier.tpot_slo_ms)
