"""Rate limits, run against both limiters (in-memory and a real Redis)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.rate_limit import (
    MemoryRateLimiter,
    RateLimitExceededError,
    RedisRateLimiter,
    TenantLimits,
    format_duration_ms,
)


@pytest.fixture(params=["memory", "redis"])
def limiter(request, clock, redis_client, keys):
    if request.param == "memory":
        return MemoryRateLimiter(clock_ms=clock)
    return RedisRateLimiter(redis_client, keys=keys, clock_ms=clock)


async def test_concurrent_reservations_never_overshoot(limiter) -> None:
    limits = TenantLimits(rpm=10_000, tpm=1_000)

    async def attempt() -> bool:
        try:
            await limiter.reserve("t", limits, 30)
        except RateLimitExceededError:
            return False
        return True

    outcomes = await asyncio.gather(*(attempt() for _ in range(100)))
    assert sum(outcomes) == 1_000 // 30


async def test_retry_after_is_the_real_wait(limiter, clock) -> None:
    limits = TenantLimits(tpm=600)  # 0.01 tokens per ms
    await limiter.reserve("t", limits, 600)
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", limits, 100)
    assert refused.value.limit == "tokens"
    assert refused.value.retry_after_ms == 10_000
    clock.advance(9_999)
    with pytest.raises(RateLimitExceededError) as again:
        await limiter.reserve("t", limits, 100)
    assert again.value.retry_after_ms == 1
    clock.advance(1)
    await limiter.reserve("t", limits, 100)


async def test_requests_per_minute(limiter, clock) -> None:
    limits = TenantLimits(rpm=2)
    await limiter.reserve("t", limits, 1)
    await limiter.reserve("t", limits, 1)
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", limits, 1)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("requests", 30_000)
    clock.advance(30_000)
    await limiter.reserve("t", limits, 1)


async def test_release_refunds_unused_tokens_once(limiter) -> None:
    limits = TenantLimits(tpm=600)
    reservation = await limiter.reserve("t", limits, 500)
    assert reservation.status.remaining_tokens == 100
    assert await limiter.release(reservation, 100)
    assert not await limiter.release(reservation, 0)
    second = await limiter.reserve("t", limits, 500)
    assert second.status.remaining_tokens == 0
    with pytest.raises(RateLimitExceededError):
        await limiter.reserve("t", limits, 1)


async def test_concurrency_cap_and_lapsed_reservations(limiter, clock) -> None:
    limits = TenantLimits(max_concurrency=2)
    first = await limiter.reserve("t", limits, 10)
    await limiter.reserve("t", limits, 10, hold_ms=1_000)
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", limits, 10)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("concurrency", None)
    assert await limiter.release(first, 10)
    await limiter.reserve("t", limits, 10)
    clock.advance(1_000)  # the second lapses: a crashed gateway leaks no slot
    await limiter.reserve("t", limits, 10)


async def test_request_larger_than_the_limit_is_never_admitted(limiter) -> None:
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", TenantLimits(tpm=100), 101)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("tokens", None)


async def test_tenants_are_independent_and_headers(limiter) -> None:
    limits = TenantLimits(rpm=60, tpm=6_000)
    await limiter.reserve("a", limits, 6_000)
    reservation = await limiter.reserve("b", limits, 1_500)
    assert reservation.status.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "4500",
        "x-ratelimit-reset-tokens": "15s",
    }


def test_duration_format() -> None:
    assert [format_duration_ms(ms) for ms in (20, 1_500, 360_000, 61_250)] == [
        "20ms",
        "1.5s",
        "6m0s",
        "1m1.25s",
    ]


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="rpm"):
        TenantLimits(rpm=0)


async def test_renewed_slots_stay_held_and_the_others_lapse(limiter, clock) -> None:
    """A gateway renews the slots of its running requests; a slot nobody renews (its
    gateway died) comes free after its hold, and a released one is not brought back."""
    limits = TenantLimits(max_concurrency=2)
    kept = await limiter.reserve("t", limits, 1, hold_ms=1_000)
    orphan = await limiter.reserve("t", limits, 1, hold_ms=1_000)
    with pytest.raises(RateLimitExceededError):
        await limiter.reserve("t", limits, 1, hold_ms=1_000)
    for _ in range(3):  # renewed every 600 ms, well past the first hold
        clock.advance(600)
        assert await limiter.renew([kept], 1_000) == 1
    # The orphan lapsed (its hold ended 800 ms ago); the kept one still holds its slot.
    assert await limiter.renew([orphan], 1_000) == 0
    again = await limiter.reserve("t", limits, 1, hold_ms=1_000)
    with pytest.raises(RateLimitExceededError):
        await limiter.reserve("t", limits, 1, hold_ms=1_000)
    assert await limiter.release(kept, 1)
    assert await limiter.renew([kept, again], 1_000) == 1  # the released one stays released
    assert await limiter.renew([], 1_000) == 0


async def test_a_limit_set_on_an_unlimited_tenant_starts_full(limiter, clock) -> None:
    # An unlimited bucket used to store a level of 0, which a limit set later read as
    # empty: five requests after PATCH rpm=10 were all refused.
    unlimited = TenantLimits(rpm=None, tpm=1_000)
    first = await limiter.reserve("t", unlimited, 10)
    assert await limiter.release(first, 10)
    clock.advance(2_000)
    limited = TenantLimits(rpm=10, tpm=None)
    for _ in range(10):
        reservation = await limiter.reserve("t", limited, 500)
    assert reservation.status.remaining_requests == 0
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", limited, 1)
    assert refused.value.limit == "requests"
    # And the token bucket, unlimited meanwhile, starts full when limited again.
    clock.advance(60_000)
    assert (await limiter.reserve("t", unlimited, 1_000)).status.remaining_tokens == 0


async def test_a_reservation_holds_a_slot_per_sequence(limiter, clock) -> None:
    limits = TenantLimits(max_concurrency=4)
    three = await limiter.reserve("t", limits, 1, hold_ms=1_000, num_slots=3)
    with pytest.raises(RateLimitExceededError) as refused:
        await limiter.reserve("t", limits, 1, num_slots=2)  # 3 + 2 > 4
    assert refused.value.limit == "concurrency"
    one = await limiter.reserve("t", limits, 1, hold_ms=1_000)  # 3 + 1 fits
    clock.advance(900)
    assert await limiter.renew([three], 1_000) == 1  # every slot of it, not only the first
    clock.advance(500)  # `one` lapsed; the three slots were renewed
    with pytest.raises(RateLimitExceededError):
        await limiter.reserve("t", limits, 1, num_slots=2)
    assert not await limiter.release(one, 0)
    assert await limiter.release(three, 0)  # all three come free
    four = await limiter.reserve("t", limits, 1, num_slots=4)
    assert four.num_slots == 4


async def test_the_slots_a_tenant_holds_name_its_requests(limiter, clock) -> None:
    limits = TenantLimits(max_concurrency=4)
    held = await limiter.reserve("t", limits, 10, reservation_id="req-a", num_slots=3, hold_ms=1000)
    await limiter.reserve("t", limits, 10, reservation_id="req-b", hold_ms=5000)
    now = clock()
    assert sorted(await limiter.inflight_slots("t")) == [
        ("req-a", now + 1000),
        ("req-a#1", now + 1000),
        ("req-a#2", now + 1000),
        ("req-b", now + 5000),
    ]
    assert await limiter.inflight_slots("other") == []
    await limiter.release(held, 10)
    assert await limiter.inflight_slots("t") == [("req-b", now + 5000)]
    clock.advance(5000)  # its hold lapsed (its gateway died)
    assert await limiter.inflight_slots("t") == []
