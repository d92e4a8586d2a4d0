"""Fixtures for the scheduler tests: a real Redis under a unique key prefix per test,
a settable clock, and both queue backends over them."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.script_channel import ScriptChannel

REDIS_URL = os.environ.get("TIERGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

TIERS = (
    TierConfig("priority", rank=0, ttft_slo_ms=500.0),
    TierConfig("interactive", rank=1, ttft_slo_ms=2000.0),
    TierConfig("batch", rank=2, min_share=0.0),
)


_job_ids = itertools.count()


def build_job(
    tenant: str = "t1",
    tier: str = "interactive",
    *,
    weight: float = 1.0,
    num_prompt_tokens: int = 10,
    max_tokens: int = 16,
    arrival_s: float = 1_700_000_000.0,
    max_queue_ms: float | None = None,
    deadline_s: float | None = None,
    job_id: str | None = None,
) -> Job:
    return Job(
        job_id=job_id or f"job-{next(_job_ids)}",
        tenant_id=tenant,
        tier=tier,
        rank=0,
        weight=weight,
        prompt_token_ids=tuple(range(1, num_prompt_tokens + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_s=arrival_s,
        max_queue_ms=max_queue_ms,
        deadline_s=deadline_s,
    )


@pytest.fixture
def make_job() -> Callable[..., Job]:
    """A factory of small valid jobs (keyword arguments override the defaults)."""
    return build_job


class FakeClock:
    """Epoch milliseconds that only move when a test says so."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


def unique_keys() -> KeySpace:
    return KeySpace(f"{{test-{uuid.uuid4().hex[:12]}}}:")


async def delete_keys(client: aioredis.Redis, keys: KeySpace) -> None:
    names = [name async for name in client.scan_iter(match=keys.pattern(), count=1000)]
    if names:
        await client.delete(*names)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def keys(redis_client: aioredis.Redis) -> AsyncIterator[KeySpace]:
    space = unique_keys()
    yield space
    await delete_keys(redis_client, space)


@pytest.fixture(params=["memory", "redis"])
async def backend(
    request: pytest.FixtureRequest,
    clock: FakeClock,
    redis_client: aioredis.Redis,
    keys: KeySpace,
) -> AsyncIterator[MemoryBackend | RedisBackend]:
    config = PolicyConfig(share_window_ms=10_000, share_buckets=5, deadline_margin_ms=5_000)
    channel = None
    if request.param == "memory":
        made: MemoryBackend | RedisBackend = MemoryBackend(config=config, clock_ms=clock)
    else:
        # Script calls over the multiplexed connection, as a gateway or worker makes them.
        channel = ScriptChannel.for_client(redis_client)
        made = RedisBackend(redis_client, keys=keys, config=config, clock_ms=clock, channel=channel)
    await made.configure_tiers(TIERS)
    yield made
    if channel is not None:
        await made.aclose()  # its result stream reader's connection
        await channel.aclose()
