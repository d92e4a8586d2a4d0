"""enqueue_many and dispatch_many on Redis give exactly what one-at-a-time calls give.

The batched calls run many jobs inside one script call, with state carried between jobs
inside the script; these tests replay the same workload both ways on a real Redis and
compare every outcome, the dispatch order and the state left behind.
"""

from __future__ import annotations

import random

import redis.asyncio as aioredis

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.redis_backend import MAX_JOBS_PER_CALL, RedisBackend
from scheduler.script_channel import ScriptChannel

from .conftest import REDIS_URL, FakeClock, delete_keys, unique_keys

TIERS = [
    TierConfig("priority", rank=0, max_queued_jobs=40),
    TierConfig("interactive", rank=1, min_share=0.3),
    TierConfig("batch", rank=2, min_share=0.1),
]
CONFIG = PolicyConfig(share_window_ms=4_000, share_buckets=4, deadline_margin_ms=2_000)


def workload(seed: int, num_jobs: int, now_ms: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for n in range(num_jobs):
        tier = rng.choice(["priority", "interactive", "batch", "batch", "unknown"])
        deadline_ms = rng.choice([None, None, None, rng.randint(0, 6_000)])
        jobs.append(
            Job(
                # A few ids repeat, so some enqueues are duplicates.
                job_id=f"j{n if rng.random() > 0.03 else rng.randrange(max(n, 1))}",
                tenant_id=f"t{rng.randrange(12)}",
                tier=tier,
                rank=0,
                weight=rng.choice([0.5, 1.0, 3.0]),
                prompt_token_ids=tuple(range(rng.randint(1, 40))),
                params=SamplingParams(max_tokens=rng.randint(1, 40)),
                arrival_s=now_ms / 1000,
                max_queue_ms=rng.choice([None, None, 500]),
                deadline_s=None if deadline_ms is None else (now_ms + deadline_ms) / 1000,
            )
        )
    return jobs


async def snapshot(backend: RedisBackend, jobs: list[Job]) -> list[object]:
    state: list[object] = [await backend.depth()]
    for tier in TIERS:
        state.append(await backend.counters(tier.name))
    state.append([await backend.job_status(job.job_id) for job in jobs])
    return state


async def run(batched: bool, seed: int, *, multiplexed: bool = False) -> list[object]:
    clock = FakeClock()
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    channel = ScriptChannel.for_client(client) if multiplexed else None
    backend = RedisBackend(client, keys=keys, config=CONFIG, clock_ms=clock, channel=channel)
    out: list[object] = []
    try:
        await backend.configure_tiers(TIERS)
        for round_ in range(3):
            jobs = workload(seed * 10 + round_, 2 * MAX_JOBS_PER_CALL + 7, clock.now_ms)
            if batched:
                out.append(await backend.enqueue_many(jobs))
            else:
                outcomes = []
                for job in jobs:
                    outcomes.append(await backend.enqueue_many([job]))
                out.append([o for one in outcomes for o in one])
            # Some queued jobs time out, and some deadlines come within the margin.
            clock.advance(700)
            if batched:
                leased = await backend.dispatch_many("w", 3_000, MAX_JOBS_PER_CALL + 13)
            else:
                leased = []
                for _ in range(MAX_JOBS_PER_CALL + 13):
                    job = await backend.dispatch("w", 3_000)
                    if job is not None:
                        leased.append(job)
            out.append([(j.job_id, j.rank, j.resumed_token_ids) for j in leased])
            for job in leased[::3]:
                await backend.charge(job.job_id, output_tokens=17)
            for job in leased[1::4]:
                await backend.publish_tokens(job.job_id, "w", [1, 2])
                await backend.requeue(job.job_id)
            out.append(await snapshot(backend, jobs))
        drained = await backend.dispatch_many("w", 3_000, 10_000)
        out.append([j.job_id for j in drained])
        out.append(await backend.dispatch_many("w", 3_000, 5))
    finally:
        if channel is not None:
            await channel.aclose()
        await delete_keys(client, keys)
        await client.aclose()
    return out


async def test_batched_calls_match_single_calls() -> None:
    for seed in range(3):
        single = await run(False, seed)
        batched = await run(True, seed)
        assert batched == single
        # Over the script channel the calls of a batch go out together: the same outcomes.
        assert await run(True, seed, multiplexed=True) == single
        # The workload really exercised every outcome and left nothing queued.
        outcomes = {o for round_ in single[0::3][:3] for o in round_}
        assert outcomes >= {"ok", "unknown_tier", "duplicate"}
        assert single[-1] == []


async def test_queue_full_inside_one_batch() -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    backend = RedisBackend(client, keys=keys, config=CONFIG, clock_ms=FakeClock())
    try:
        await backend.configure_tiers(TIERS)
        jobs = workload(1, 60, FakeClock().now_ms)
        jobs = [
            Job(**{**job.__dict__, "job_id": f"p{i}", "tier": "priority"})
            for i, job in enumerate(jobs)
        ]
        outcomes = await backend.enqueue_many(jobs)
        assert outcomes == ["ok"] * 40 + ["queue_full"] * 20
        assert len(await backend.dispatch_many("w", 1_000, 100)) == 40
    finally:
        await delete_keys(client, keys)
        await client.aclose()


async def test_fields_with_separators_round_trip() -> None:
    # The queue's fields travel tab-separated and leased jobs come back "|"-separated;
    # ids and text holding those characters must come back unchanged.
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    backend = RedisBackend(client, keys=keys, config=CONFIG, clock_ms=FakeClock())
    try:
        await backend.configure_tiers(TIERS)
        job = Job(
            job_id="id|with\ttab",
            tenant_id="tenant\twith|pipe\n",
            tier="interactive",
            rank=1,
            weight=1.5,
            prompt_token_ids=(1, 2, 3),
            params=SamplingParams(max_tokens=4, stop=("|", "\t")),
            arrival_s=1_700_000_000.0,
            metadata={"note": "a|b\tc"},
        )
        assert await backend.enqueue_many([job]) == ["ok"]
        (leased,) = await backend.dispatch_many("w", 1_000, 3)
        assert leased == job
        assert await backend.publish_tokens(job.job_id, "w", [7, 8])
        assert await backend.requeue(job.job_id)
        again = await backend.dispatch("w", 1_000)
        assert again == Job(**{**job.__dict__, "resumed_token_ids": (7, 8)})
        assert (await backend.depth()) == {}
    finally:
        await delete_keys(client, keys)
        await client.aclose()


class CountingRedis(aioredis.Redis):
    """A real client that counts the commands it sends, pipelines included."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    async def execute_command(self, *args, **options):
        self.sent.append(str(args[0]))
        return await super().execute_command(*args, **options)

    def pipeline(self, *args, **kwargs):
        self.sent.append("PIPELINE")
        return super().pipeline(*args, **kwargs)


async def test_dispatch_many_costs_one_call_unless_the_queue_holds_more() -> None:
    client = CountingRedis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    clock = FakeClock()
    backend = RedisBackend(client, keys=keys, config=CONFIG, clock_ms=clock)
    try:
        await backend.configure_tiers(TIERS)
        jobs = [
            Job(
                job_id=f"b{i}",
                tenant_id=f"t{i % 7}",
                tier="batch",
                rank=2,
                weight=1.0,
                prompt_token_ids=(1, 2, 3),
                params=SamplingParams(max_tokens=4),
                arrival_s=clock.now_ms / 1000,
            )
            for i in range(2 * MAX_JOBS_PER_CALL + 40)
        ]
        assert set(await backend.enqueue_many(jobs)) == {"ok"}

        async def leased(num_jobs: int) -> tuple[int, list[str]]:
            client.sent.clear()
            got = await backend.dispatch_many("w", 3_000, num_jobs)
            return len(got), list(client.sent)

        # No pipeline: a pipeline of scripts would first ask SCRIPT EXISTS.
        assert await leased(30) == (30, ["EVALSHA"])
        assert await leased(2 * MAX_JOBS_PER_CALL + 5) == (
            2 * MAX_JOBS_PER_CALL + 5,
            ["EVALSHA"] * 3,
        )
        # The queue holds fewer than asked: one call that comes back short, no second.
        assert await leased(MAX_JOBS_PER_CALL) == (5, ["EVALSHA"])
        assert await leased(10) == (0, ["EVALSHA"])
    finally:
        await delete_keys(client, keys)
        await client.aclose()
