"""How long a tenant at its concurrency cap waits for a slot, from the whole fleet.

A gateway knows the requests that stream through it, but behind a load balancer a
tenant's running requests stream through every gateway, and a refusal's Retry-After must
count them all: counted from this gateway's streams alone, with the fleet's time for one
request like the refused one when none streamed here, it told a client 12 ms while the
tenant's running request had 2 s left.

The tenant's slots are held in the rate limiter, one per choice, named after the
request (scheduler.rate_limit.slot_ids); each names its job, whose progress the queue
knows. A slot frees:

- when its running job ends: the k-th release among them (scheduler.slot_release,
  with the stop curve this gateway learned) at the pace they stream;
- when its queued job has waited for one of the fleet's slot releases and then run;
- when its hold lapses, for a job whose gateway died (nobody releases its slot before
  the lapse, however soon the job ends) or that has ended with its slot still held;
- a slot whose job is not queued yet (reserved a moment ago) is left out.

The pace is the tenant's jobs' own, each from its current run (JobProgress.pace_s: a
job resumed after its worker died goes on at its new worker's pace, and the seconds its
stream stood still in between are no part of it; counted in, a wait of 13 s was told as
60 s), from those whose run has streamed enough tokens for it to mean something (the
first few steps of a run go behind prefills); else what `fallback_pace_s` says (this
gateway's other streams); else each job's tokens left take what `service_s` says (the
pace the engines report giving each of their sequences). It is read at a refusal only,
and kept a moment per tenant: a client hammering at its cap costs one read every
CACHE_S.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from engine.stop_hazard import StopCurve
from gateway.openai.choices import choice_job_id
from scheduler.backend import FleetCapacity, JobStatus, QueueBackend
from scheduler.results import MIN_PACE_TOKENS
from scheduler.slot_release import release_steps

MAX_SLOTS_READ = 64  # a tenant's slots read at most (its limit may be in the hundreds)
CACHE_S = 0.25
MAX_CACHED_TENANTS = 1_000
_RUNNING = (JobStatus.QUEUED, JobStatus.LEASED)


def slot_job_id(slot_id: str) -> str:
    """The job holding a concurrency slot: slot i of request r (r, r#1, r#2...) is the
    job of its choice i (gateway.openai.choices.choice_job_id)."""
    head, sep, tail = slot_id.partition("#")
    return choice_job_id(head, int(tail)) if sep and tail.isdigit() else slot_id


class FleetReleases:
    """Seconds until the tenant's held slots, wherever its requests stream, free."""

    def __init__(
        self,
        limiter: Any,  # MemoryRateLimiter or RedisRateLimiter
        backend: QueueBackend,
        *,
        stop_curve: Callable[[], StopCurve | None],
        fallback_pace_s: Callable[[], float | None],
        service_s: Callable[[int], Awaitable[float | None]],
        fleet_capacity: Callable[[], Awaitable[FleetCapacity]],
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        cache_s: float = CACHE_S,
    ) -> None:
        self._limiter = limiter
        self._backend = backend
        self._stop_curve = stop_curve
        self._fallback_pace_s = fallback_pace_s
        self._service_s = service_s
        self._fleet_capacity = fleet_capacity
        self._clock_ms = clock_ms
        self._cache_s = cache_s
        # (tenant, slots) -> (monotonic expiry, seconds or None); LRU order.
        self._cache: OrderedDict[tuple[str, int], tuple[float, float | None]] = OrderedDict()

    async def release_s(self, tenant_id: str, num_slots: int) -> float | None:
        """When `num_slots` of the tenant's held slots are expected to have freed; None
        when nothing says (no held slot names a job, or no pace is known)."""
        key = (tenant_id, max(num_slots, 1))
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        seconds = await self._estimate(tenant_id, key[1])
        self._cache[key] = (now + self._cache_s, seconds)
        self._cache.move_to_end(key)
        while len(self._cache) > MAX_CACHED_TENANTS:
            self._cache.popitem(last=False)
        return seconds

    async def _estimate(self, tenant_id: str, num_slots: int) -> float | None:
        slots = (await self._limiter.inflight_slots(tenant_id))[:MAX_SLOTS_READ]
        lapses = {slot_job_id(slot): until for slot, until in slots}
        progress = await self._backend.job_progress(list(lapses))
        now_ms = self._clock_ms()
        releases: list[float] = []  # seconds
        leased: list[tuple[int, int, bool]] = []  # (tokens left, made, may stop)
        queued: list[int] = []  # tokens left
        paces: list[float] = []
        for job in progress:
            made = job.num_tokens
            pace = job.pace_s(MIN_PACE_TOKENS)
            if pace is not None:
                paces.append(pace)
            if job.status not in _RUNNING or job.is_orphaned:
                releases.append(max(0.0, (lapses[job.job_id] - now_ms) / 1000.0))
            elif job.status is JobStatus.QUEUED:
                queued.append(job.max_tokens - made)
            else:
                leased.append((job.max_tokens - made, made, job.can_stop_early))
        if leased or queued:
            runs = await self._runs_s(leased, queued, paces, num_slots)
            if runs is None:
                return None
            leased_s, queued_s = runs
            releases += leased_s
            if queued_s:
                # Each waits for one of the fleet's next slot releases, then runs.
                waits = (await self._fleet_capacity()).release_ms or ()
                for i, run_s in enumerate(sorted(queued_s)):
                    wait_s = waits[min(i, len(waits) - 1)] / 1000.0 if waits else 0.0
                    releases.append(wait_s + run_s)
        if not releases:
            return None
        releases.sort()
        return releases[min(num_slots, len(releases)) - 1]

    async def _runs_s(
        self,
        leased: list[tuple[int, int, bool]],
        queued: list[int],
        paces: list[float],
        num_slots: int,
    ) -> tuple[list[float], list[float]] | None:
        """Seconds until the first `num_slots` leased jobs end, and each queued job's
        run; None when neither a pace nor the engines' reports tell."""
        pace = statistics.median(paces) if paces else self._fallback_pace_s()
        if pace is not None:
            steps = release_steps(leased, self._stop_curve(), limit=num_slots)
            return [step * pace for step in steps], [left * pace for left in queued]
        times = [await self._service_s(left) for left in [n for n, _, _ in leased] + queued]
        known = [t for t in times if t is not None]
        if len(known) < len(times):
            return None
        return known[: len(leased)], known[len(leased) :]
