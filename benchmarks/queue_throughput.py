"""Queue speed: Redis enqueue+dispatch pairs/s against raw Redis, and in-memory dispatch p99.

    python benchmarks/queue_throughput.py [--redis-url redis://127.0.0.1:6379/0]

1. Redis backend: 1,000 tenants over 3 tiers; jobs are enqueued and then dispatched in
   pipelined batches (each enqueue and each dispatch is one atomic Lua script), against
   raw RPUSH + LPOP pipelined the same way on the same server, in the same run.
   Goal: at least 25% of raw.
2. In-memory backend with 1,000 backlogged tenants: the latency of one dispatch decision
   (policy pick + lease + prompt charge). Goal: p99 <= 100 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as aioredis

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend

TIERS = [
    TierConfig("priority", rank=0),
    TierConfig("interactive", rank=1, min_share=0.2),
    TierConfig("batch", rank=2, min_share=0.05),
]
NUM_TENANTS = 1_000
PARAMS = SamplingParams(max_tokens=64)
PROMPT = tuple(range(32))


def make_jobs(num_jobs: int, run: str) -> list[Job]:
    now_s = time.time()
    return [
        Job(
            job_id=f"{run}-{i}",
            tenant_id=f"tenant-{i % NUM_TENANTS}",
            tier=TIERS[i % NUM_TENANTS % len(TIERS)].name,
            rank=0,
            weight=1.0 + (i % 3),
            prompt_token_ids=PROMPT,
            params=PARAMS,
            arrival_s=now_s,
        )
        for i in range(num_jobs)
    ]


async def redis_pairs_per_s(client: aioredis.Redis, num_jobs: int, batch: int) -> float:
    keys = KeySpace(f"{{bench-{uuid.uuid4().hex[:8]}}}:")
    backend = RedisBackend(client, keys=keys)
    await backend.configure_tiers(TIERS)
    jobs = make_jobs(num_jobs, "q")
    try:
        start = time.perf_counter()
        for i in range(0, num_jobs, batch):
            outcomes = await backend.enqueue_many(jobs[i : i + batch])
            assert all(o == "ok" for o in outcomes), outcomes[:3]
        num_dispatched = 0
        while num_dispatched < num_jobs:
            num_dispatched += len(await backend.dispatch_many("bench", 60_000, batch))
        elapsed = time.perf_counter() - start
    finally:
        await _delete(client, keys.pattern())
    return num_jobs / elapsed


async def raw_pairs_per_s(client: aioredis.Redis, num_jobs: int, batch: int) -> float:
    prefix = f"{{raw-{uuid.uuid4().hex[:8]}}}:"
    payload = make_jobs(1, "raw")[0].to_json()
    try:
        start = time.perf_counter()
        for i in range(0, num_jobs, batch):
            async with client.pipeline(transaction=False) as pipe:
                for j in range(i, min(i + batch, num_jobs)):
                    pipe.rpush(f"{prefix}{j % NUM_TENANTS}", payload)
                await pipe.execute()
        for i in range(0, num_jobs, batch):
            async with client.pipeline(transaction=False) as pipe:
                for j in range(i, min(i + batch, num_jobs)):
                    pipe.lpop(f"{prefix}{j % NUM_TENANTS}")
                await pipe.execute()
        elapsed = time.perf_counter() - start
    finally:
        await _delete(client, prefix.replace("{", "\\{").replace("}", "\\}") + "*")
    return num_jobs / elapsed


async def _delete(client: aioredis.Redis, pattern: str) -> None:
    names = [n async for n in client.scan_iter(match=pattern, count=5_000)]
    for i in range(0, len(names), 1_000):
        await client.delete(*names[i : i + 1_000])


async def memory_dispatch_latency_us(num_jobs: int) -> tuple[float, float]:
    backend = MemoryBackend(TIERS)
    for job in make_jobs(num_jobs, "m"):
        await backend.enqueue(job)
    samples = []
    for _ in range(num_jobs // 2):  # every tenant stays backlogged throughout
        start = time.perf_counter_ns()
        job = await backend.dispatch("bench", 60_000)
        samples.append((time.perf_counter_ns() - start) / 1_000)
        await backend.charge(job.job_id, output_tokens=64)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()

    client = aioredis.Redis.from_url(args.redis_url, decode_responses=True)
    try:
        raw = await raw_pairs_per_s(client, args.jobs, args.batch)
        ours = await redis_pairs_per_s(client, args.jobs, args.batch)
    finally:
        await client.aclose()
    print(f"redis backend: {ours:,.0f} enqueue+dispatch pairs/s ({NUM_TENANTS} tenants, 3 tiers)")
    print(f"raw RPUSH+LPOP pipelined: {raw:,.0f} pairs/s")
    print(f"ratio: {ours / raw:.1%} of raw (goal >= 25%)")
    p50, p99 = await memory_dispatch_latency_us(args.jobs)
    print(
        f"memory backend dispatch ({NUM_TENANTS} backlogged tenants): p50 {p50:.1f} µs, "
        f"p99 {p99:.1f} µs (goal p99 <= 100 µs)"
    )


if __name__ == "__main__":
    asyncio.run(main())
