"""Admission at the gateway: rate limits, SLO admission and enqueue, as HTTP errors.

After a request is authenticated and validated, `Admission.reserve` takes one request
and prompt + max_tokens tokens from the tenant's RPM/TPM buckets and a concurrency slot;
`Admission.enqueue` refuses work its tier's TTFT SLO cannot cover (predicted from the
work queued ahead and the fleet's measured capacity) and queues the rest. The unused
part of the reservation is refunded when the request ends (`release_soon`).

The scheduler's refusals become the gateway's typed errors here, with the
`x-ratelimit-*` headers and the real wait as Retry-After; the error table renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.auth import Principal
from gateway.concurrency_wait import FleetReleases
from gateway.errors import InvalidRequestError, RateLimitedError, ServiceUnavailableError
from gateway.tiers import TierPolicy
from scheduler.admission import AdmissionConfig, NoCapacityError, job_service_ms, slo_budget
from scheduler.backend import (
    BackendUnavailableError,
    FleetCapacity,
    QueueBackend,
    QueueFullError,
    SloBudget,
    SloUnattainableError,
    UnknownTierError,
)
from scheduler.job import Job
from scheduler.policy import TierConfig
from scheduler.rate_limit import (
    RateLimitExceededError,
    RequestExceedsLimitError,
    Reservation,
    TenantLimits,
)
from scheduler.results import JobClient, JobStream, QueueTimeoutError
from scheduler.slot_release import nth_release_ms

log = logging.getLogger(__name__)

RATE_LIMIT_CODES = {
    "requests": "rate_limit_exceeded",
    "tokens": "rate_limit_exceeded",
    "concurrency": "concurrency_limit_exceeded",
}


def tier_config(tier: TierPolicy) -> TierConfig:
    """What the queue needs to know about a tier row."""
    return TierConfig(
        name=tier.name,
        rank=tier.rank,
        min_share=tier.min_share,
        ttft_slo_ms=tier.ttft_slo_ms,
        max_queued_jobs=tier.max_queued_jobs,
    )


def unavailable(exc: BackendUnavailableError) -> ServiceUnavailableError:
    # The cause goes with the message: "unreachable" alone leaves an operator guessing.
    return ServiceUnavailableError(
        f"The request queue is unreachable ({exc}); retry shortly.", code="queue_unavailable"
    )


# A request's concurrency slot lapses this long after its gateway last renewed it, and
# the gateway renews the slots of its running requests every RENEW_EVERY_S: a gateway
# that dies takes its tenants' slots away for at most HOLD_MS, not for the limiter's
# ten-minute default.
HOLD_MS = 30_000
RENEW_EVERY_S = 10.0

# Workers report their capacity once per heartbeat (1 s), so reading it again for every
# request (three Redis round trips) bought nothing; a value this young is as fresh.
CAPACITY_MAX_AGE_MS = 100.0


def _too_large_message(tpm: int, job: Job, num_choices: int, max_tokens_given: bool) -> str:
    """Why a request larger than the whole TPM limit is refused, and what fits."""
    n = num_choices
    each = "max_tokens" if n == 1 else f"{n} x max_tokens"
    num_tokens = job.num_prompt_tokens + n * job.params.max_tokens
    message = (
        f"Request too large: {num_tokens} tokens (prompt + {each}) exceed the limit of "
        f"{tpm} tokens per minute."
    )
    room = (tpm - job.num_prompt_tokens) // n
    lower_n = "" if n == 1 else "lower n, "
    if job.num_prompt_tokens >= tpm:
        advice = "Shorten the prompt."  # alone, it takes the whole limit
    elif room < 1:
        advice = "Lower n, or shorten the prompt."
    elif max_tokens_given:
        advice = f"Set max_tokens to at most {room}, {lower_n}or shorten the prompt."
    else:
        advice = (
            f"max_tokens was not set, so it defaulted to {job.params.max_tokens} "
            f"(the rest of the context); set it to at most {room}"
            + (", or lower n." if n > 1 else ".")
        )
    return f"{message} {advice}"


class RecentCapacity:
    """The fleet's capacity as SLO admission reads it: `fleet_capacity` remembered for
    `max_age_ms`. The work queued ahead, which changes with every enqueue, the queue
    reads itself as it enqueues."""

    def __init__(self, backend: QueueBackend, max_age_ms: float) -> None:
        self._backend = backend
        self._max_age_s = max_age_ms / 1000.0
        self._capacity: FleetCapacity | None = None
        self._read_at_s = 0.0

    async def fleet_capacity(self) -> FleetCapacity:
        now_s = time.monotonic()
        if self._capacity is None or now_s - self._read_at_s > self._max_age_s:
            self._capacity = await self._backend.fleet_capacity()
            self._read_at_s = now_s
        return self._capacity


class Admission:
    """Rate limits, SLO admission and enqueue for one gateway process."""

    def __init__(
        self,
        limiter: Any,  # MemoryRateLimiter or RedisRateLimiter
        jobs: JobClient,
        *,
        config: AdmissionConfig | None = None,
        queue_timeout_grace_ms: float = 250.0,
        on_unknown_tier: Callable[[], Awaitable[None]] | None = None,
        capacity_max_age_ms: float = CAPACITY_MAX_AGE_MS,
        hold_ms: int = HOLD_MS,
        renew_every_s: float = RENEW_EVERY_S,
    ) -> None:
        if not 0 < renew_every_s * 1000 < hold_ms:
            raise ValueError("reservations must be renewed more often than they lapse")
        self._limiter = limiter
        self._hold_ms = hold_ms
        self._renew_every_s = renew_every_s
        self._held: dict[str, Reservation] = {}  # id -> reservation of a running request
        self._renewer: asyncio.Task[None] | None = None
        self._capacity = RecentCapacity(jobs.backend, capacity_max_age_ms)
        self._on_unknown_tier = on_unknown_tier
        self._jobs = jobs
        self._config = config or AdmissionConfig()
        self._grace_ms = queue_timeout_grace_ms
        self._releases: set[asyncio.Task[None]] = set()
        # The waits at a tenant's concurrency cap, from its requests wherever they run
        # (through other gateways too, in a fleet).
        self._fleet_releases = FleetReleases(
            limiter,
            jobs.backend,
            stop_curve=lambda: jobs.stop_hazard.curve,
            fallback_pace_s=jobs.stream_pace_s,
            service_s=self._decode_s,
            fleet_capacity=self._capacity.fleet_capacity,
        )

    @property
    def backend(self) -> QueueBackend:
        return self._jobs.backend

    async def reserve(
        self,
        principal: Principal,
        job: Job,
        *,
        num_choices: int = 1,
        num_prompts: int = 1,
        num_tokens: int | None = None,
        max_tokens_given: bool = True,
    ) -> Reservation:
        """Take a request, its prompt + num_choices x max_tokens tokens (the prompt is
        billed once, as OpenAI counts it) and a concurrency slot per choice (each runs
        as a sequence of its own) from the tenant's limits, or raise
        RateLimitedError (429) with the expected wait and the x-ratelimit-* headers
        (InvalidRequestError, 400, if the request exceeds the whole TPM limit: no wait
        would help). `max_tokens_given`: whether the client set max_tokens (else the
        endpoint's default did, which the 400 then says). `num_tokens`: the whole
        request's tokens (several prompts are each billed once, each with its own
        max_tokens); by default, `job`'s prompt and num_choices x its max_tokens."""
        limits = TenantLimits(
            rpm=principal.rpm, tpm=principal.tpm, max_concurrency=principal.max_concurrency
        )
        if num_tokens is None:
            num_tokens = job.num_prompt_tokens + num_choices * job.params.max_tokens
        try:
            reservation = await self._limiter.reserve(
                principal.tenant_id,
                limits,
                num_tokens,
                # Its slots name the request's jobs (gateway.concurrency_wait).
                reservation_id=job.job_id,
                hold_ms=self._hold_ms,
                num_slots=num_choices,
            )
            self._hold(reservation)
            return reservation
        except RequestExceedsLimitError as exc:
            if num_prompts > 1:
                message = (
                    f"Request too large: {num_tokens} tokens (its prompts + max_tokens "
                    f"of each of its {num_choices} choices) exceed the limit of "
                    f"{principal.tpm} tokens per minute. Send fewer prompts, or lower "
                    "max_tokens or n."
                )
            else:
                message = _too_large_message(principal.tpm or 0, job, num_choices, max_tokens_given)
            raise InvalidRequestError(
                message, param="max_tokens", code="exceeds_token_limit"
            ) from exc
        except RateLimitExceededError as exc:
            if exc.retry_after_ms is not None:
                retry_s: float | None = exc.retry_after_ms / 1000.0
            else:
                retry_s = await self._concurrency_wait_s(job, exc.num_slots_short)
            raise RateLimitedError(
                exc.message,
                code=RATE_LIMIT_CODES[exc.limit],
                retry_after_s=retry_s,
                headers=exc.status.headers(),
            ) from exc
        except BackendUnavailableError as exc:
            raise unavailable(exc) from exc

    async def enqueue(
        self,
        job: Job,
        tier: TierPolicy,
        *,
        headers: dict[str, str] | None = None,
        check_slo: bool = True,
    ) -> JobStream:
        """SLO admission (unless `check_slo` is False: a request's later choices, whose
        first tokens are not its TTFT), then enqueue; returns the job's result stream."""
        headers = headers or {}
        try:
            slo = await self._slo_budget(tier) if check_slo else None
            timeout_ms = None if job.max_queue_ms is None else job.max_queue_ms + self._grace_ms
            try:
                return await self._jobs.submit_and_wait(job, queue_timeout_ms=timeout_ms, slo=slo)
            except UnknownTierError:
                # The queue lost its tier table (Redis restarted empty, or a new tier
                # raced its announcement): copy it again from SQL and retry once.
                if self._on_unknown_tier is None:
                    raise
                await self._on_unknown_tier()
                return await self._jobs.submit_and_wait(job, queue_timeout_ms=timeout_ms, slo=slo)
        except SloUnattainableError as exc:
            raise RateLimitedError(
                str(exc),
                code="slo_unattainable",
                retry_after_s=exc.retry_after_ms / 1000.0,
                headers=headers,
            ) from exc
        except QueueFullError as exc:
            raise RateLimitedError(
                f"The {exc.tier!r} queue is full; retry later.",
                code="queue_full",
                retry_after_s=await self._queue_place_s(job, tier.rank),
                headers=headers,
            ) from exc
        except NoCapacityError as exc:
            raise ServiceUnavailableError(
                "No worker is available to serve this request.", code="no_capacity"
            ) from exc
        except BackendUnavailableError as exc:
            raise unavailable(exc) from exc

    async def _slo_budget(self, tier: TierPolicy) -> SloBudget | None:
        """What the queue checks the job against as it enqueues it (None: no TTFT SLO).
        Raises NoCapacityError when no live worker reports capacity, whatever the tier:
        a request nothing can serve is answered 503 at once instead of waiting."""
        capacity = await self._capacity.fleet_capacity()
        if tier.ttft_slo_ms is None:
            if capacity.num_workers == 0:
                raise NoCapacityError("no live worker reports any capacity")
            return None
        return slo_budget(capacity, self._config, rank=tier.rank, ttft_slo_ms=tier.ttft_slo_ms)

    async def _queue_place_s(self, job: Job, rank: int) -> float | None:
        """When a full tier queue has a place again: when one of its jobs leaves it for a
        sequence slot. With none free and none to preempt, that is the fleet's next slot
        release after those the requests of its rank or better waiting in engines take;
        else about the fleet's time for one job like this one. (That time alone, a few
        milliseconds for a short job, was told while every slot held seconds of work.)"""
        try:
            capacity = await self._capacity.fleet_capacity()
        except BackendUnavailableError:
            return None
        is_full = capacity.num_free_seqs <= 0 and capacity.num_preemptible_seqs(rank) <= 0
        if is_full and capacity.release_ms:
            return nth_release_ms(capacity.release_ms, capacity.num_waiting_ahead(rank)) / 1000.0
        return await self._service_s(job)

    async def _concurrency_wait_s(self, job: Job, num_slots_short: int) -> float | None:
        """At the concurrency cap, slots free as the tenant's requests end: when as
        many as must end are expected to, from the queue's view of every one of them,
        the ones streaming here included (gateway.concurrency_wait). The fleet's time
        for one request like this one is the last resort: it was 15 ms where a tenant's
        one running request had seconds left, and its client retried 60 times a second."""
        retry_s = None
        with contextlib.suppress(BackendUnavailableError):
            retry_s = await self._fleet_releases.release_s(job.tenant_id, num_slots_short)
        if retry_s is None:
            retry_s = await self._service_s(job)
        return retry_s

    async def _service_s(self, job: Job) -> float | None:
        """The fleet's time for one job like `job` (None if unknown)."""
        return await self._work_s(job.num_prompt_tokens, job.params.max_tokens)

    async def _decode_s(self, num_tokens: int) -> float | None:
        """A running sequence's time for `num_tokens` output tokens: at the pace the
        engines give each of their sequences (an engine's decode rate over its running
        sequences; the median over the live workers), else at the fleet's rates (None if
        unknown). The fleet's rates alone gave a sequence the whole fleet's speed: a
        wait several times too short on a busy one."""
        try:
            reports = await self._jobs.backend.worker_reports()
        except BackendUnavailableError:
            return None
        paces = [
            r.num_running / r.decode_tokens_per_s
            for r in reports
            if r.num_running and r.decode_tokens_per_s > 0
        ]
        if paces:
            return num_tokens * statistics.median(paces)
        return await self._work_s(0, num_tokens)

    async def _work_s(self, num_prompt_tokens: int, max_tokens: int) -> float | None:
        try:
            capacity = await self._capacity.fleet_capacity()
        except BackendUnavailableError:
            return None
        service_ms = job_service_ms(
            capacity, self._config, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens
        )
        return None if service_ms is None else service_ms / 1000.0

    async def queue_timeout_refusal(
        self, exc: QueueTimeoutError, job: Job, tier: TierPolicy, headers: dict[str, str]
    ) -> RateLimitedError:
        """The 429 for a job dropped after its tier's max_queue_ms, with the wait after
        which the same request would leave the queue in time: the predicted time to its
        first token behind the work queued now, less the tier's queue limit (as an SLO
        refusal's wait is the prediction less the SLO), and at least the fleet's time
        for one such job."""
        retry_s = await self._service_s(job)
        try:
            capacity = await self._capacity.fleet_capacity()
            budget = slo_budget(capacity, self._config, rank=tier.rank, ttft_slo_ms=math.inf)
            work = await self.backend.work_ahead(
                job.tier, job.tenant_id, job.weight, job.num_prompt_tokens
            )
        except (NoCapacityError, BackendUnavailableError):
            pass
        else:
            over_ms = budget.predict_ms(work, job.num_prompt_tokens) - (job.max_queue_ms or 0.0)
            retry_s = max(retry_s or 0.0, over_ms / 1000.0)
        return RateLimitedError(
            str(exc), code="queue_timeout", retry_after_s=retry_s, headers=headers
        )

    def _hold(self, reservation: Reservation) -> None:
        self._held[reservation.reservation_id] = reservation
        if self._renewer is None or self._renewer.done():
            # Its own context: started by a request, its lines carried that request's id.
            self._renewer = asyncio.create_task(
                self._renew(), name="rate-limit-renewer", context=contextvars.Context()
            )

    async def _renew(self) -> None:
        """Keep the slots of this gateway's running requests from lapsing."""
        while self._held:
            await asyncio.sleep(self._renew_every_s)
            try:
                await self._limiter.renew(list(self._held.values()), self._hold_ms)
            except Exception as exc:  # Redis away: the next round tries again
                log.warning("could not renew %d rate limit reservations: %r", len(self._held), exc)

    def release_soon(self, reservation: Reservation | None, num_used_tokens: int) -> None:
        """Refund the unused tokens and free the concurrency slot, in the background (the
        request has answered already). A lost release lapses after the hold time."""
        if reservation is None:
            return
        self._held.pop(reservation.reservation_id, None)
        task = asyncio.create_task(self._release(reservation, num_used_tokens))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, reservation: Reservation, num_used_tokens: int) -> None:
        try:
            await self._limiter.release(reservation, num_used_tokens)
        except Exception as exc:
            log.warning("could not release a rate limit reservation: %r", exc)

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
