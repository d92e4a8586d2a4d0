"""Per-tenant rate limits: RPM and TPM token buckets and a concurrency cap.

`reserve` atomically takes one request and prompt + max_tokens tokens (and a concurrency
slot per sequence it runs: a request with n choices takes n) or refuses without taking
anything; `release` at completion frees the slot and
refunds the tokens reserved but not used. Concurrent reservations never overshoot: the
memory limiter runs each decision without yielding, the Redis one in one Lua script.

Levels are integers in 1/60000 of a token (or request), so a limit of L per minute refills
exactly L units per ms and the wait reported in a refusal is exact: retrying after
`retry_after_ms` passes (absent other traffic), retrying 1 ms earlier does not.
A reservation lapses after `hold_ms` so a crashed gateway cannot leak concurrency; a
gateway `renew`s the reservations of its running requests, so a short hold bounds what a
crash leaks without cutting a long request's slot.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import redis.asyncio as aioredis

from scheduler.keys import KeySpace
from scheduler.redis_backend import load_script_source, unavailable_as_error
from scheduler.script_channel import ScriptChannel, run_script

UNITS_PER_TOKEN = 60_000  # one token (or request) in bucket units; ms per minute
DEFAULT_HOLD_MS = 600_000

LimitName = Literal["requests", "tokens", "concurrency"]


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's effective limits (tier defaults with its overrides); None = unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1 or None")


@dataclass(frozen=True)
class RateLimitStatus:
    """Where a tenant's buckets stand, for the x-ratelimit-* response headers."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_ms: int | None  # until the bucket is full again
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_ms: int | None

    def headers(self) -> dict[str, str]:
        """`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the limits that exist."""
        out: dict[str, str] = {}
        for kind in ("requests", "tokens"):
            limit = getattr(self, f"limit_{kind}")
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(getattr(self, f"remaining_{kind}"))
            out[f"x-ratelimit-reset-{kind}"] = format_duration_ms(getattr(self, f"reset_{kind}_ms"))
        return out


def format_duration_ms(ms: int) -> str:
    """OpenAI's reset format: 20ms, 1.5s, 6m0s."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms_left = divmod(ms, 60_000)
    seconds = f"{ms_left / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


@dataclass(frozen=True)
class Reservation:
    """What `reserve` took; hand it back to `release` when the request ends."""

    reservation_id: str
    tenant_id: str
    num_tokens: int
    limits: TenantLimits
    status: RateLimitStatus
    num_slots: int = 1  # concurrency slots held

    @property
    def slot_ids(self) -> list[str]:
        """The in-flight entries of its slots: the reservation id, then id#1, id#2..."""
        return slot_ids(self.reservation_id, self.num_slots)


def slot_ids(reservation_id: str, num_slots: int) -> list[str]:
    return [reservation_id] + [f"{reservation_id}#{i}" for i in range(1, num_slots)]


class RateLimitExceededError(Exception):
    """A refusal: `limit` says which; `retry_after_ms` is the real wait until the same
    request would pass (None when waiting alone cannot help: the request is larger than
    the TPM limit, or the tenant is at its concurrency cap until a request ends)."""

    def __init__(
        self,
        limit: LimitName,
        retry_after_ms: int | None,
        status: RateLimitStatus,
        message: str,
        num_slots_short: int = 0,
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_ms = retry_after_ms
        self.status = status
        self.message = message
        # At the concurrency cap: how many of the tenant's running requests must end first.
        self.num_slots_short = num_slots_short


@dataclass
class _Bucket:
    req: int | None = None  # None: full (see _level)
    tok: int | None = None
    ts_ms: int | None = None
    inflight: dict[str, int] = field(default_factory=dict)  # reservation id -> lapses at ms


def _status(limits: TenantLimits, req: int, tok: int) -> RateLimitStatus:
    def view(limit: int | None, level: int) -> tuple[int | None, int | None, int | None]:
        if limit is None:
            return None, None, None
        return limit, level // UNITS_PER_TOKEN, -(-(limit * UNITS_PER_TOKEN - level) // limit)

    return RateLimitStatus(*view(limits.rpm, req), *view(limits.tpm, tok))


class RequestExceedsLimitError(RateLimitExceededError):
    """prompt + max_tokens exceed the tenant's whole TPM limit: no wait makes the request
    fit, so it is an invalid request (400), not a "not now" (429)."""


def _refused(
    outcome: str,
    wait_ms: int,
    limits: TenantLimits,
    num_tokens: int,
    status: RateLimitStatus,
    num_slots_short: int = 0,
) -> RateLimitExceededError:
    if outcome == "too_large":
        return RequestExceedsLimitError(
            "tokens",
            None,
            status,
            f"Request too large: {num_tokens} tokens (prompt + max_tokens) exceed the limit of "
            f"{limits.tpm} tokens per minute.",
        )
    if outcome == "concurrency":
        return RateLimitExceededError(
            "concurrency",
            None,
            status,
            f"Too many concurrent requests (limit {limits.max_concurrency}).",
            num_slots_short,
        )
    per_minute = limits.rpm if outcome == "requests" else limits.tpm
    return RateLimitExceededError(
        outcome,  # type: ignore[arg-type]
        wait_ms,
        status,
        f"Rate limit reached for {outcome} per minute (limit {per_minute}); retry in {wait_ms} ms.",
    )


def _level(level: int | None, per_minute: int) -> int:
    """A bucket's stored level; a bucket that kept none (no limit until now, or a new
    tenant) is full, so that a limit set on an unlimited tenant starts it full."""
    return per_minute * UNITS_PER_TOKEN if level is None else level


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class MemoryRateLimiter:
    """Rate limits for a single process."""

    def __init__(self, *, clock_ms: Callable[[], int] = wall_clock_ms) -> None:
        self._clock_ms = clock_ms
        self._buckets: dict[str, _Bucket] = {}

    async def reserve(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        *,
        reservation_id: str | None = None,
        hold_ms: int = DEFAULT_HOLD_MS,
        num_slots: int = 1,
    ) -> Reservation:
        """Take one request, `num_tokens` tokens and `num_slots` concurrency slots, or
        raise RateLimitExceededError."""
        now = self._clock_ms()
        rid = reservation_id or uuid.uuid4().hex
        b = self._buckets.setdefault(tenant_id, _Bucket())
        for key in [k for k, until in b.inflight.items() if until <= now]:
            del b.inflight[key]
        rpm, tpm, max_conc = limits.rpm or 0, limits.tpm or 0, limits.max_concurrency or 0
        elapsed = 0 if b.ts_ms is None else max(0, now - b.ts_ms)
        req = min(rpm * UNITS_PER_TOKEN, _level(b.req, rpm) + elapsed * rpm)
        tok = min(tpm * UNITS_PER_TOKEN, _level(b.tok, tpm) + elapsed * tpm)
        outcome, wait = "ok", 0
        cost = num_tokens * UNITS_PER_TOKEN
        if tpm and num_tokens > tpm:
            outcome = "too_large"
        elif max_conc and len(b.inflight) + num_slots > max_conc:
            outcome = "concurrency"
        else:
            req_wait = -(-(UNITS_PER_TOKEN - req) // rpm) if rpm and req < UNITS_PER_TOKEN else 0
            tok_wait = -(-(cost - tok) // tpm) if tpm and tok < cost else 0
            if req_wait or tok_wait:
                outcome = "requests" if req_wait >= tok_wait else "tokens"
                wait = max(req_wait, tok_wait)
        if outcome != "ok":
            short = len(b.inflight) + num_slots - max_conc
            raise _refused(outcome, wait, limits, num_tokens, _status(limits, req, tok), short)
        b.req = req - UNITS_PER_TOKEN if rpm else None
        b.tok = tok - cost if tpm else None
        b.ts_ms = now
        for slot in slot_ids(rid, num_slots):
            b.inflight[slot] = now + hold_ms
        status = _status(limits, b.req or 0, b.tok or 0)  # a level is None only unlimited
        return Reservation(rid, tenant_id, num_tokens, limits, status, num_slots)

    async def inflight_slots(self, tenant_id: str) -> list[tuple[str, int]]:
        """The tenant's concurrency slots held now (Reservation.slot_ids of its running
        requests), each with the ms its hold lapses at unless renewed, in no particular
        order."""
        now = self._clock_ms()
        b = self._buckets.get(tenant_id)
        return (
            []
            if b is None
            else [(slot, until) for slot, until in b.inflight.items() if until > now]
        )

    async def renew(self, reservations: Sequence[Reservation], hold_ms: int) -> int:
        """Hold the slots of `reservations` for `hold_ms` from now; how many were still
        held (a lapsed or released one is not brought back)."""
        now = self._clock_ms()
        renewed = 0
        for reservation in reservations:
            b = self._buckets.get(reservation.tenant_id)
            until = None if b is None else b.inflight.get(reservation.reservation_id)
            if b is not None and until is not None and until > now:
                for slot in reservation.slot_ids:
                    b.inflight[slot] = now + hold_ms
                renewed += 1
        return renewed

    async def release(self, reservation: Reservation, num_used_tokens: int) -> bool:
        """Free the concurrency slot and refund unused tokens; False if already released."""
        b = self._buckets.get(reservation.tenant_id)
        if b is None or b.inflight.pop(reservation.reservation_id, None) is None:
            return False
        for slot in reservation.slot_ids[1:]:
            b.inflight.pop(slot, None)
        if b.ts_ms is None:
            return True
        now = self._clock_ms()
        rpm, tpm = reservation.limits.rpm or 0, reservation.limits.tpm or 0
        refund = max(0, reservation.num_tokens - num_used_tokens) * UNITS_PER_TOKEN
        elapsed = max(0, now - b.ts_ms)
        b.req = min(rpm * UNITS_PER_TOKEN, _level(b.req, rpm) + elapsed * rpm) if rpm else None
        b.tok = (
            min(tpm * UNITS_PER_TOKEN, _level(b.tok, tpm) + elapsed * tpm + refund) if tpm else None
        )
        b.ts_ms = now
        return True


class RedisRateLimiter:
    """Rate limits shared by every gateway through Redis (one Lua script per operation)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        keys: KeySpace | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        channel: ScriptChannel | None = None,
    ) -> None:
        """Script calls go over `channel` when given (its owner closes it), else through
        redis-py."""
        self._redis = client
        self._channel = channel
        self._keys = keys or KeySpace()
        self._clock_ms = clock_ms
        self._reserve = client.register_script(
            load_script_source("rate_reserve", with_queue_lib=False)
        )
        self._release = client.register_script(
            load_script_source("rate_release", with_queue_lib=False)
        )
        self._renew = client.register_script(load_script_source("rate_renew", with_queue_lib=False))

    async def inflight_slots(self, tenant_id: str) -> list[tuple[str, int]]:
        """As MemoryRateLimiter.inflight_slots."""
        with unavailable_as_error():
            held = await self._redis.zrangebyscore(
                self._keys.rate_inflight(tenant_id), f"({self._clock_ms()}", "+inf", withscores=True
            )
        return [(slot, int(until)) for slot, until in held]

    async def renew(self, reservations: Sequence[Reservation], hold_ms: int) -> int:
        """As MemoryRateLimiter.renew, in one script call (rate_renew.lua)."""
        if not reservations:
            return 0
        args: list[object] = [self._keys.prefix, self._clock_ms(), hold_ms]
        for reservation in reservations:
            args += [reservation.tenant_id, reservation.reservation_id, reservation.num_slots]
        with unavailable_as_error():
            return int(await run_script(self._renew, self._channel, args))

    async def reserve(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        *,
        reservation_id: str | None = None,
        hold_ms: int = DEFAULT_HOLD_MS,
        num_slots: int = 1,
    ) -> Reservation:
        """As MemoryRateLimiter.reserve, in one script call (rate_reserve.lua)."""
        rid = reservation_id or uuid.uuid4().hex
        with unavailable_as_error():
            outcome, wait, req, tok, inflight = await run_script(
                self._reserve,
                self._channel,
                [
                    self._keys.prefix,
                    self._clock_ms(),
                    tenant_id,
                    limits.rpm or 0,
                    limits.tpm or 0,
                    limits.max_concurrency or 0,
                    int(num_tokens),
                    rid,
                    hold_ms,
                    num_slots,
                ],
            )
        status = _status(limits, int(req), int(tok))
        if outcome != "ok":
            short = int(inflight) + num_slots - (limits.max_concurrency or 0)
            raise _refused(outcome, int(wait), limits, num_tokens, status, short)
        return Reservation(rid, tenant_id, num_tokens, limits, status, num_slots)

    async def release(self, reservation: Reservation, num_used_tokens: int) -> bool:
        """Free the concurrency slot and refund unused tokens; False if already released."""
        refund = max(0, reservation.num_tokens - num_used_tokens)
        with unavailable_as_error():
            released = await run_script(
                self._release,
                self._channel,
                [
                    self._keys.prefix,
                    self._clock_ms(),
                    reservation.tenant_id,
                    reservation.limits.rpm or 0,
                    reservation.limits.tpm or 0,
                    reservation.reservation_id,
                    refund,
                    reservation.num_slots,
                ],
            )
        return bool(released)


__all__ = [
    "DEFAULT_HOLD_MS",
    "MemoryRateLimiter",
    "RateLimitExceededError",
    "RateLimitStatus",
    "RedisRateLimiter",
    "Reservation",
    "TenantLimits",
    "format_duration_ms",
]
