"""The min_share window keeps only its own buckets in Redis, whatever the tiers' shares."""

from __future__ import annotations

import redis.asyncio as aioredis

from scheduler.keys import FAMILIES, KeySpace
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.redis_backend import RedisBackend

from .conftest import FakeClock, build_job


async def test_share_buckets_are_pruned_without_min_share(
    redis_client: aioredis.Redis, keys: KeySpace
) -> None:
    clock = FakeClock()
    config = PolicyConfig(share_window_ms=4_000, share_buckets=4)
    backend = RedisBackend(redis_client, keys=keys, config=config, clock_ms=clock)
    # No tier has a min_share, so no dispatch ever needs a window sum.
    await backend.configure_tiers([TierConfig("interactive", rank=0)])
    for _ in range(30):
        await backend.enqueue(build_job("t1", "interactive"))
        job = await backend.dispatch("w", 1_000)
        assert job is not None
        await backend.charge(job.job_id, output_tokens=5)
        clock.advance(1_000)  # one bucket per round
    for family in ("share_total", "share"):
        key = keys.prefix + FAMILIES[family] + ("interactive" if family == "share" else "")
        assert 1 <= await redis_client.hlen(key) <= config.share_buckets + 1
