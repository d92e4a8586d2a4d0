"""Queue speed: Redis enqueue+dispatch pairs/s against raw Redis, and in-memory dispatch p99.

    python benchmarks/queue_throughput.py [--redis-url redis://127.0.0.1:6379/0] [--reps 5]

1. Redis backend: 1,000 tenants over 3 tiers; jobs are enqueued and then dispatched in
   pipelined batches of --batch (enqueue_many / dispatch_many: every job is still its own
   atomic policy decision), against raw RPUSH + LPOP of the same payload to the same
   1,000 keys, pipelined in the same batches, on the same server. The backend sends its
   script calls over its script channel, as gateways and workers do; raw goes through
   redis-py (a pipeline per batch, a call per command). Raw and backend runs
   alternate, after a warm-up of each; the ratio is taken per repetition (so both sides
   see the same machine load) and the median is reported. Goal: at least 25% of raw.
2. The same with one job per round trip (enqueue / dispatch against RPUSH / LPOP), the
   shape of one gateway request and one worker pick.
3. In-memory backend with 1,000 backlogged tenants: the latency of one dispatch decision
   (policy pick + lease + prompt charge), wall clock and the thread's CPU time (which a
   loaded machine does not inflate by preempting the process). Median over repetitions.
   Goal: p99 <= 100 µs.

The load average is printed with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.script_channel import ScriptChannel

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
            rank=TIERS[i % NUM_TENANTS % len(TIERS)].rank,  # as the gateway admits it
            weight=1.0 + (i % 3),
            prompt_token_ids=PROMPT,
            params=PARAMS,
            arrival_s=now_s,
        )
        for i in range(num_jobs)
    ]


async def redis_pairs_per_s(client: aioredis.Redis, num_jobs: int, batch: int) -> float:
    """Backend enqueue+dispatch pairs per second; batch 1 = one call per round trip."""
    keys = KeySpace(f"{{bench-{uuid.uuid4().hex[:8]}}}:")
    channel = ScriptChannel.for_client(client)  # script calls as gateways and workers make them
    backend = RedisBackend(client, keys=keys, channel=channel)
    await backend.configure_tiers(TIERS)
    jobs = make_jobs(num_jobs, "q")
    try:
        start = time.perf_counter()
        if batch == 1:
            for job in jobs:
                await backend.enqueue(job)
            while await backend.dispatch("bench", 60_000) is not None:
                pass
        else:
            for i in range(0, num_jobs, batch):
                outcomes = await backend.enqueue_many(jobs[i : i + batch])
                if any(o != "ok" for o in outcomes):
                    raise RuntimeError(f"enqueue refused: {outcomes[:3]}")
            num_dispatched = 0
            while num_dispatched < num_jobs:
                num_dispatched += len(await backend.dispatch_many("bench", 60_000, batch))
        elapsed = time.perf_counter() - start
    finally:
        if channel is not None:
            await channel.aclose()
        await _delete(client, keys.pattern())
    return num_jobs / elapsed


async def raw_pairs_per_s(client: aioredis.Redis, num_jobs: int, batch: int) -> float:
    """RPUSH+LPOP pairs per second, pipelined in the same batches as the backend."""
    prefix = f"{{raw-{uuid.uuid4().hex[:8]}}}:"
    # The same payload the backend stores for each job.
    payload = make_jobs(1, "raw")[0].to_json()
    try:
        start = time.perf_counter()
        if batch == 1:
            for j in range(num_jobs):
                await client.rpush(f"{prefix}{j % NUM_TENANTS}", payload)
            for j in range(num_jobs):
                await client.lpop(f"{prefix}{j % NUM_TENANTS}")
        else:
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


Measure = Callable[[aioredis.Redis, int, int], Awaitable[float]]


async def compare(
    client: aioredis.Redis, num_jobs: int, batch: int, reps: int
) -> tuple[float, float, list[float]]:
    """Median backend and raw rates and each repetition's ratio, runs alternating."""
    await raw_pairs_per_s(client, max(num_jobs // 10, 1), batch)  # warm-up
    await redis_pairs_per_s(client, max(num_jobs // 10, 1), batch)
    ours, raw, ratios = [], [], []
    for rep in range(reps):
        order: list[Measure] = [redis_pairs_per_s, raw_pairs_per_s]
        if rep % 2:
            order.reverse()
        rates = {m: await m(client, num_jobs, batch) for m in order}
        ours.append(rates[redis_pairs_per_s])
        raw.append(rates[raw_pairs_per_s])
        ratios.append(ours[-1] / raw[-1])
    return statistics.median(ours), statistics.median(raw), ratios


async def memory_dispatch_latency_us(num_jobs: int) -> tuple[float, float, float, float]:
    """p50 and p99 of one dispatch, wall clock and thread CPU time, in µs."""
    backend = MemoryBackend(TIERS)
    for job in make_jobs(num_jobs, "m"):
        await backend.enqueue(job)
    gc.collect()  # the setup's garbage is not the dispatch's to collect
    wall, cpu = [], []
    for _ in range(num_jobs // 2):  # every tenant stays backlogged throughout
        start_wall, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        job = await backend.dispatch("bench", 60_000)
        cpu.append((time.thread_time_ns() - start_cpu) / 1_000)
        wall.append((time.perf_counter_ns() - start_wall) / 1_000)
        if job is None:
            raise RuntimeError("the queue ran dry")
        await backend.charge(job.job_id, output_tokens=64)
    wall.sort()
    cpu.sort()
    p99 = int(len(wall) * 0.99)
    return statistics.median(wall), wall[p99], statistics.median(cpu), cpu[p99]


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _spread(values: list[float]) -> str:
    return f"(min {min(values):.1%}, max {max(values):.1%})"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--single-jobs", type=int, default=2_000, help="0 skips part 2")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    print(f"{os.cpu_count()} CPUs, {_load()}")
    client = aioredis.Redis.from_url(args.redis_url, decode_responses=True)
    try:
        ours, raw, ratios = await compare(client, args.jobs, args.batch, args.reps)
        print(
            f"pipelined, batches of {args.batch} ({NUM_TENANTS} tenants, 3 tiers, "
            f"median of {args.reps}): redis backend {ours:,.0f} enqueue+dispatch pairs/s, "
            f"raw RPUSH+LPOP {raw:,.0f} pairs/s"
        )
        print(f"  ratio {statistics.median(ratios):.1%} of raw {_spread(ratios)} (goal >= 25%)")
        if args.single_jobs:
            ours, raw, ratios = await compare(client, args.single_jobs, 1, args.reps)
            print(
                f"one job per round trip: redis backend {ours:,.0f} pairs/s, raw {raw:,.0f} "
                f"pairs/s, ratio {statistics.median(ratios):.1%} {_spread(ratios)}"
            )
    finally:
        await client.aclose()
    runs = [await memory_dispatch_latency_us(args.jobs) for _ in range(args.reps)]
    wall50, wall99, cpu50, cpu99 = (statistics.median(r[i] for r in runs) for i in range(4))
    print(
        f"memory backend dispatch ({NUM_TENANTS} backlogged tenants, median of {args.reps}): "
        f"wall p50 {wall50:.1f} µs, p99 {wall99:.1f} µs; CPU p50 {cpu50:.1f} µs, "
        f"p99 {cpu99:.1f} µs (goal p99 <= 100 µs)"
    )
    print(_load())


if __name__ == "__main__":
    asyncio.run(main())
