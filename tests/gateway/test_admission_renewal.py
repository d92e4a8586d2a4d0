"""A gateway renews the concurrency slots of its running requests, so a slot outlives its
short hold while the request runs, and a gateway that goes away leaves its tenants'
slots for one hold only. Two gateways (Admission) on one real Redis limiter."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from engine.request import SamplingParams
from gateway.admission import Admission
from gateway.auth import Principal
from gateway.errors import RateLimitedError
from gateway.tiers import TierPolicy
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.rate_limit import RedisRateLimiter
from scheduler.results import JobClient
from tests.conftest import REDIS_URL

HOLD_MS = 400
RENEW_EVERY_S = 0.1
TIER = TierPolicy(
    "interactive", 1, None, None, None, None, None, 0.0, False, None, None, None, 0, 0
)


def _principal() -> Principal:
    return Principal("ten_a", "a", "key_a", TIER, 1.0, rpm=None, tpm=None, max_concurrency=1)


def _job() -> Job:
    return Job(
        job_id=f"req_{uuid.uuid4().hex}",
        tenant_id="ten_a",
        tier="interactive",
        rank=1,
        weight=1.0,
        prompt_token_ids=(1, 2, 3),
        params=SamplingParams(max_tokens=4),
        arrival_s=time.time(),
    )


@pytest.fixture
async def gateways():
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = KeySpace(f"{{test-renew-{uuid.uuid4().hex[:8]}}}:")
    limiter = RedisRateLimiter(client, keys=keys)
    made = [
        Admission(limiter, JobClient(MemoryBackend()), hold_ms=HOLD_MS, renew_every_s=RENEW_EVERY_S)
        for _ in range(2)
    ]
    try:
        yield made
    finally:
        for admission in made:
            await admission.aclose()
        names = [k async for k in client.scan_iter(match=f"{keys.prefix}*")]
        if names:
            await client.delete(*names)
        await client.aclose()


async def test_a_running_request_keeps_its_slot_past_the_hold(gateways) -> None:
    first, other = gateways
    held = await first.reserve(_principal(), _job())
    await asyncio.sleep(3 * HOLD_MS / 1000)  # renewed meanwhile
    with pytest.raises(RateLimitedError) as refused:
        await other.reserve(_principal(), _job())
    assert refused.value.code == "concurrency_limit_exceeded"
    first.release_soon(held, 7)
    await first.aclose()  # waits for the release
    await other.reserve(_principal(), _job())


async def test_a_gateway_gone_frees_its_slots_after_one_hold(gateways) -> None:
    first, other = gateways
    await first.reserve(_principal(), _job())
    await first.aclose()  # stops renewing without releasing: as a gateway that died
    with pytest.raises(RateLimitedError):
        await other.reserve(_principal(), _job())
    await asyncio.sleep(1.5 * HOLD_MS / 1000)
    await other.reserve(_principal(), _job())


def test_renewing_less_often_than_the_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="renewed more often"):
        Admission(None, JobClient(MemoryBackend()), hold_ms=100, renew_every_s=0.5)
