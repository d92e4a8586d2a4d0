"""The gateway's per-tenant rate limits on the simulator's clock.

Rate limits are gateway admission: they run before the queue policy sees a request, so
every simulated policy gets the same ones. This is the real `MemoryRateLimiter` reading
the virtual clock: at arrival a request reserves one request and prompt + max_tokens
tokens from its tenant's RPM/TPM buckets and a concurrency slot; the reservation is
released when the request finishes (unused tokens refunded), or in full when a later
stage refuses it (SLO admission, queue cap) or the queue drops it, as the gateway does.
"""

from __future__ import annotations

from scheduler.rate_limit import MemoryRateLimiter, RateLimitExceededError, Reservation
from scheduler.sim.admission import CONCURRENCY_LIMIT_EXCEEDED, RATE_LIMIT_EXCEEDED
from scheduler.sim.tiered import run_now
from scheduler.sim.workload import SimRequest, WorkloadSpec

# The gateway's `code` for each limit (gateway/admission.py RATE_LIMIT_CODES).
LIMIT_CODES = {
    "requests": RATE_LIMIT_EXCEEDED,
    "tokens": RATE_LIMIT_EXCEEDED,
    "concurrency": CONCURRENCY_LIMIT_EXCEEDED,
}


class SimRateLimits:
    """Reservations of the workload's tenants against their effective limits."""

    def __init__(self, workload: WorkloadSpec, clock: list[float]) -> None:
        tiers = {t.name: t for t in workload.tiers}
        self._limits = {}
        for tenant in workload.tenants:
            limits = tenant.effective_limits(tiers[tenant.tier])
            if (limits.rpm, limits.tpm, limits.max_concurrency) != (None, None, None):
                self._limits[tenant.tenant_id] = limits
        self._limiter = MemoryRateLimiter(clock_ms=lambda: int(clock[0] * 1000))
        self._held: dict[str, Reservation] = {}

    @property
    def is_active(self) -> bool:
        """Whether any tenant has a limit (if not, nothing needs checking)."""
        return bool(self._limits)

    def reserve(self, req: SimRequest) -> str | None:
        """Take the request's share of its tenant's limits: None, or the refusal code."""
        limits = self._limits.get(req.tenant_id)
        if limits is None:
            return None
        num_tokens = req.num_prompt_tokens + req.asked_tokens  # prompt + max_tokens
        try:
            reservation = run_now(
                self._limiter.reserve(
                    req.tenant_id, limits, num_tokens, reservation_id=req.request_id
                )
            )
        except RateLimitExceededError as exc:
            return LIMIT_CODES[exc.limit]
        self._held[req.request_id] = reservation
        return None

    def release(self, request_id: str, num_used_tokens: int) -> None:
        """The request ended (or was refused or dropped after reserving)."""
        reservation = self._held.pop(request_id, None)
        if reservation is not None:
            run_now(self._limiter.release(reservation, num_used_tokens))

    def num_held(self, tenant_id: str) -> int:
        """Requests of the tenant holding a reservation (its concurrency in use)."""
        return sum(1 for r in self._held.values() if r.tenant_id == tenant_id)
