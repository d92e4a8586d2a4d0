"""How far jobs have run (QueueBackend.job_progress): what a gateway reads to tell a
tenant at its concurrency cap when a slot frees, whichever gateway its requests stream
through. Both backends, the same answers."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.backend import JobProgress, JobStatus
from scheduler.memory_backend import MemoryBackend
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
    for token in range(5):  # one engine step each, the lease's queue wait on the first
        wait = None if token else 1.0
        assert await backend.publish_step("running", "w1", [token], queue_wait_ms=wait)
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
    for step in range(4):
        wait = None if step else 1.0
        assert await backend.publish_step("batched", "w1", list(range(5)), queue_wait_ms=wait)
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


STEP_MS = 5
GAP_MS = 600  # the dead worker's lease lapsing, then the job's reclaim and new lease


async def _stream_steps(backend, job_id: str, worker_id: str, num_steps: int, clock) -> None:
    """One token a step, STEP_MS apart (by the test clock, and by Redis's: its stream
    ids are its own ms), the lease's queue wait on the first as a worker sends it."""
    for step in range(num_steps):
        wait = 1.0 if step == 0 else None
        assert await backend.publish_step(job_id, worker_id, [step], queue_wait_ms=wait)
        await _pass_ms(clock, STEP_MS, backend)


async def _pass_ms(clock, ms: int, backend) -> None:
    clock.advance(ms)
    if isinstance(backend, RedisBackend):
        await asyncio.sleep(ms / 1000)


async def test_a_resumed_job_goes_at_its_current_runs_pace(backend, make_job, clock) -> None:
    # Its worker died after 10 tokens; its lease lapsed, it was reclaimed and another
    # worker resumed it. The lapse is no part of its pace: counted in, a tenant at its
    # cap was told 59.6 s for a wait of 12.9 s.
    await backend.enqueue(make_job("t", job_id="resumed", max_tokens=100))
    await backend.dispatch("w-dead", LEASE_MS)
    await _stream_steps(backend, "resumed", "w-dead", 10, clock)
    (before,) = await backend.job_progress(["resumed"])
    assert (before.run_first_token_ms, before.run_num_tokens) == (before.first_token_ms, 10)
    await _pass_ms(clock, GAP_MS, backend)
    clock.advance(LEASE_MS)
    assert await backend.reclaim_expired_leases() == ["resumed"]
    job = await backend.dispatch("w-new", LEASE_MS)
    assert job is not None
    assert len(job.resumed_token_ids) == 10
    await _stream_steps(backend, "resumed", "w-new", 10, clock)
    (after,) = await backend.job_progress(["resumed"])
    assert (after.num_tokens, after.run_num_tokens) == (20, 10)
    assert after.first_token_ms == before.first_token_ms
    assert after.run_first_token_ms is not None
    assert before.last_token_ms is not None
    assert after.run_first_token_ms - before.last_token_ms >= GAP_MS
    pace = after.pace_s(8)
    assert pace is not None
    # From the new run's first token to its last: nine steps, none of the gap.
    assert pace < GAP_MS / 1000 / 9
    if isinstance(backend, MemoryBackend):
        assert pace == pytest.approx(STEP_MS / 1000)
    # Until the new run has made 8 tokens of its own, it has no pace (its 20 in all
    # would have given one).
    assert after.pace_s(11) is None


async def test_a_job_handed_back_restarts_its_pace_too(backend, make_job, clock) -> None:
    # A drain hands the job back (requeue); its next lease begins a new run, even one
    # that only ends it (its first worker streamed all its tokens but the end).
    await backend.enqueue(make_job("t", job_id="handed", max_tokens=12))
    await backend.dispatch("w1", LEASE_MS)
    await _stream_steps(backend, "handed", "w1", 12, clock)
    assert await backend.requeue("handed", worker_id="w1")
    await _pass_ms(clock, GAP_MS, backend)
    await backend.dispatch("w2", LEASE_MS)
    assert await backend.publish_step(
        "handed", "w2", (), finish_reason="length", queue_wait_ms=GAP_MS
    )
    (progress,) = await backend.job_progress(["handed"])
    assert (progress.status, progress.num_tokens, progress.run_num_tokens) == (
        JobStatus.DONE,
        12,
        0,
    )
    assert progress.pace_s(8) is None


async def test_a_job_resumed_by_an_older_worker_is_paced_from_its_first_token(
    backend, make_job, clock, redis_client
) -> None:
    # A worker of the release before marks no run in the job hash: its pace is counted
    # over the whole stream, as that release did.
    if not isinstance(backend, RedisBackend):
        return  # one release at a time runs in a process
    await backend.enqueue(make_job("t", job_id="old-run", max_tokens=100))
    await backend.dispatch("w1", LEASE_MS)
    await _stream_steps(backend, "old-run", "w1", 10, clock)
    await backend.requeue("old-run", worker_id="w1")
    await backend.dispatch("w2", LEASE_MS)
    await _stream_steps(backend, "old-run", "w2", 10, clock)
    (marked,) = await backend.job_progress(["old-run"])
    assert marked.run_num_tokens == 10
    await redis_client.hdel(backend.keys.job("old-run"), "rf", "rb")
    (unmarked,) = await backend.job_progress(["old-run"])
    assert (unmarked.run_first_token_ms, unmarked.run_num_tokens) == (
        unmarked.first_token_ms,
        20,
    )
