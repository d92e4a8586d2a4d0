"""How far jobs have run (QueueBackend.job_progress): what a gateway reads to tell a
tenant at its concurrency cap when a slot frees, whichever gateway its requests stream
through. Both backends, the same answers."""

from __future__ import annotations

import asyncio

from scheduler.backend import JobProgress, JobStatus
from scheduler.redis_backend import RedisBackend

LEASE_MS = 5_000


async def test_progress_of_queued_and_leased_jobs(backend, make_job, clock) -> None:
    await backend.enqueue(make_job("t", job_id="running", max_tokens=40))
    await backend.enqueue(make_job("t", job_id="done", max_tokens=8))
    await backend.enqueue(make_job("t", job_id="queued", max_tokens=30))
    assert [j.job_id for j in await backend.dispatch_many("w1", LEASE_MS, 2)] == [
        "running",
        "done",
    ]
    for token in range(5):  # one engine step each
        assert await backend.publish_step("running", "w1", [token], queue_wait_ms=1.0)
        clock.advance(100)
        await asyncio.sleep(0.002)  # the Redis backend's stream ids are Redis's ms
    assert await backend.publish_step("done", "w1", [1], finish_reason="stop")
    progress = await backend.job_progress(["queued", "running", "done", "unknown"])
    assert [(p.job_id, p.status, p.max_tokens, p.num_tokens) for p in progress] == [
        ("queued", JobStatus.QUEUED, 30, 0),
        ("running", JobStatus.LEASED, 40, 5),
        ("done", JobStatus.DONE, 8, 1),
    ]
    queued, running, _ = progress
    assert (queued.first_token_ms, queued.last_token_ms) == (None, None)
    assert running.first_token_ms is not None
    assert running.last_token_ms is not None
    assert running.first_token_ms < running.last_token_ms
    assert await backend.job_progress([]) == []
    assert isinstance(running, JobProgress)


async def test_a_job_whose_gateway_died_is_orphaned(backend, make_job) -> None:
    # The Redis queue knows its gateway's presence; in process, no gateway dies alone.
    await backend.publish_gateway("gw-up", 60_000)
    await backend.enqueue(make_job("t", job_id="kept"), gateway_id="gw-up")
    await backend.enqueue(make_job("t", job_id="orphan"), gateway_id="gw-gone")
    await backend.enqueue(make_job("t", job_id="anonymous"))
    progress = await backend.job_progress(["kept", "orphan", "anonymous"])
    assert [(p.job_id, p.is_orphaned) for p in progress] == [
        ("kept", False),
        ("orphan", isinstance(backend, RedisBackend)),
        ("anonymous", False),
    ]


async def test_tokens_are_counted_not_entries(backend, make_job) -> None:
    # Under load a worker streams several steps' tokens in one entry: counted as one
    # token each, 19 entries of 99 tokens told a tenant 2-10x too long a wait.
    await backend.enqueue(make_job("t", job_id="batched", max_tokens=100))
    await backend.enqueue(make_job("t", job_id="one-event", max_tokens=100))
    await backend.dispatch_many("w1", LEASE_MS, 2)
    for _ in range(4):
        assert await backend.publish_step("batched", "w1", list(range(5)), queue_wait_ms=1.0)
        await asyncio.sleep(0.002)
    assert await backend.publish_tokens("one-event", "w1", [1, 2, 3])
    assert await backend.publish_step("batched", "w1", [7, 8], finish_reason="length")
    progress = await backend.job_progress(["batched", "one-event"])
    assert [(p.job_id, p.num_tokens) for p in progress] == [("batched", 22), ("one-event", 3)]


async def test_a_job_streamed_by_workers_of_two_releases_counts_both(
    backend, make_job, redis_client
) -> None:
    # A rolling upgrade: a worker of the release before (which keeps no `nt` count)
    # streamed 12 tokens, one entry each, then died; a new worker resumed the job.
    if not isinstance(backend, RedisBackend):
        return  # one release at a time runs in a process
    await backend.enqueue(make_job("t", job_id="rolled", max_tokens=100))
    await backend.dispatch_many("w-old", LEASE_MS, 1)
    results = backend._keys.results("rolled")
    for token in range(12):
        await redis_client.xadd(results, {"k": "tokens", "t": str(token), "x": "a"})
    await backend.requeue("rolled", worker_id="w-old")
    await backend.dispatch_many("w-new", LEASE_MS, 1)
    assert await backend.publish_step("rolled", "w-new", [1, 2, 3])
    (progress,) = await backend.job_progress(["rolled"])
    assert progress.num_tokens == 15
