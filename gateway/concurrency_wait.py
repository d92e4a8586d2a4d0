"""How long a tenant at its concurrency cap waits for a slot, from the whole fleet.

A gateway knows the requests that stream through it (JobClient.tenant_release_s), but
behind a load balancer a tenant's running requests stream through every gateway, and a
refusal's Retry-After must count them all: the fallback before this, the fleet's time
for one request like the refused one, told a client 30 ms while the tenant's running
request had seconds left (it retried 30 times a second).

The tenant's slots are held in the rate limiter, one per choice, named after the
request (scheduler.rate_limit.slot_ids); each names its job, whose progress the queue
knows: its max_tokens and the tokens it has streamed, and when. The k-th release among
them (scheduler.slot_release, with the stop curve this gateway learned) at the pace
they stream is the wait. It is read at a refusal only, and kept a moment per tenant: a
client hammering at its cap costs one read per tenant every CACHE_S.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from engine.stop_hazard import StopCurve
from gateway.openai.choices import choice_job_id
from scheduler.backend import QueueBackend
from scheduler.slot_release import release_steps

MAX_SLOTS_READ = 64  # a tenant's slots read at most (its limit may be in the hundreds)
CACHE_S = 0.25
MAX_CACHED_TENANTS = 1_000


def slot_job_id(slot_id: str) -> str:
    """The job holding a concurrency slot: slot i of request r (r, r#1, r#2...) is the
    job of its choice i (gateway.openai.choices.choice_job_id)."""
    head, sep, tail = slot_id.partition("#")
    return choice_job_id(head, int(tail)) if sep and tail.isdigit() else slot_id


class FleetReleases:
    """Seconds until the tenant's running requests, wherever they stream, free slots."""

    def __init__(
        self,
        limiter: Any,  # MemoryRateLimiter or RedisRateLimiter
        backend: QueueBackend,
        stop_curve: Callable[[], StopCurve | None],
    ) -> None:
        self._limiter = limiter
        self._backend = backend
        self._stop_curve = stop_curve
        # (tenant, slots) -> (monotonic expiry, seconds or None); LRU order.
        self._cache: OrderedDict[tuple[str, int], tuple[float, float | None]] = OrderedDict()

    async def release_s(self, tenant_id: str, num_slots: int) -> float | None:
        """When `num_slots` of the tenant's held slots are expected to have freed; None
        when none of its jobs has streamed two tokens yet (no pace to go by)."""
        key = (tenant_id, max(num_slots, 1))
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        seconds = await self._estimate(tenant_id, key[1])
        self._cache[key] = (now + CACHE_S, seconds)
        self._cache.move_to_end(key)
        while len(self._cache) > MAX_CACHED_TENANTS:
            self._cache.popitem(last=False)
        return seconds

    async def _estimate(self, tenant_id: str, num_slots: int) -> float | None:
        slots = (await self._limiter.inflight_slots(tenant_id))[:MAX_SLOTS_READ]
        progress = await self._backend.job_progress([slot_job_id(s) for s in slots])
        running, paces = [], []
        for job in progress:
            made = job.num_tokens
            # A queued one frees its slot after its whole run at least.
            running.append((job.max_tokens - made, made, True))
            first, last = job.first_token_ms, job.last_token_ms
            if made >= 2 and first is not None and last is not None and last > first:
                paces.append((last - first) / 1000.0 / (made - 1))
        if not running or not paces:
            return None
        steps = release_steps(running, self._stop_curve(), limit=num_slots)
        return steps[-1] * statistics.median(paces)
