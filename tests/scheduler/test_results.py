"""The gateway's end of a job (JobClient, JobStream) on a real Redis, no worker.

A client that goes away while its job is still queued must get its handler back at
once: the job leaves the queue and the stream's reader stops, even when the reader's
cancellation lands where redis-py swallows it (while it takes or opens a connection)
and no result event will ever arrive to end the read.

In the background a client keeps its gateway's presence in the queue, retries the
cancels a stalled Redis did not take until they land, and answers a request that waits
on a fleet with no live worker with NoCapacityError (a batch line keeps waiting).
"""

from __future__ import annotations

import asyncio
import contextvars
import time

import pytest
import redis.asyncio as aioredis

from engine.errors import RequestAbortedError
from scheduler.admission import NoCapacityError
from scheduler.backend import BackendUnavailableError, JobStatus
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.results import JobClient
from tests.fleet_processes import RedisServer
from tests.scheduler.conftest import REDIS_URL, build_job, delete_keys, unique_keys

TIERS = [TierConfig("interactive", rank=1)]
NUM_JOBS = 40
CANCEL_BOUND_S = 2.0  # a result read blocks 500 ms at most; a hang is unbounded


@pytest.fixture
async def backend():
    keys = unique_keys()
    # A fresh pool per test: every reader opens its own connection, the moment where a
    # cancellation is most easily lost.
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True, max_connections=4096)
    made = RedisBackend(client, keys=keys)
    await made.configure_tiers(TIERS)
    yield made
    await delete_keys(client, keys)
    await client.aclose()


async def test_cancelling_queued_jobs_ends_their_streams_promptly(backend) -> None:
    jobs = JobClient(backend, poll_ms=500)  # no worker: every job stays queued
    loop = asyncio.get_running_loop()
    kept, cancelled = [], []
    slowest_s = 0.0
    for i in range(NUM_JOBS):
        # Every other job stays open, holding its connection, so the next reader has to
        # open one of its own; the cancel lands at a different point of that each time.
        kept.append(await jobs.submit_and_wait(build_job(job_id=f"k{i}", tier="interactive")))
        stream = await jobs.submit_and_wait(build_job(job_id=f"q{i}", tier="interactive"))
        for _ in range(i % 12):
            await asyncio.sleep(0)
        start = loop.time()
        assert await asyncio.wait_for(jobs.cancel(f"q{i}"), timeout=CANCEL_BOUND_S * 5)
        slowest_s = max(slowest_s, loop.time() - start)
        cancelled.append(stream)
    assert slowest_s < CANCEL_BOUND_S, f"slowest cancel {slowest_s:.2f}s"
    for i, stream in enumerate(cancelled):
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        assert stream._reader is not None
        assert stream._reader.done()
        assert await backend.job_status(f"q{i}") is JobStatus.CANCELLED
    assert jobs.num_open == len(kept)
    start = loop.time()
    await asyncio.wait_for(jobs.aclose(), timeout=CANCEL_BOUND_S * 2)
    assert loop.time() - start < CANCEL_BOUND_S
    assert all(s._reader is not None and s._reader.done() for s in kept)
    assert jobs.num_open == 0


@pytest.mark.parametrize("num_yields", [0, 2, 4, 6, 8, 10])
async def test_closing_the_client_stops_readers_that_are_still_connecting(
    backend, num_yields: int
) -> None:
    jobs = JobClient(backend, poll_ms=500)
    loop = asyncio.get_running_loop()
    # submit() enqueues in the background: at the close, the readers are opening their
    # connections, enqueueing or starting their first read.
    streams = [jobs.submit(build_job(job_id=f"c{i}", tier="interactive")) for i in range(8)]
    for _ in range(num_yields):
        await asyncio.sleep(0)
    start = loop.time()
    await asyncio.wait_for(jobs.aclose(), timeout=CANCEL_BOUND_S * 2)
    # wait_for alone would not do: a close that swallows its own cancellation returns.
    assert loop.time() - start < CANCEL_BOUND_S
    assert all(s._reader is not None and s._reader.done() for s in streams)
    await asyncio.sleep(0.1)
    for i in range(8):  # enqueued or not, none is left queued
        assert await backend.job_status(f"c{i}") in (None, JobStatus.CANCELLED)


async def _until(predicate, timeout_s: float) -> float:
    """Seconds until the (async) predicate held; fails after timeout_s."""
    started_s = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started_s < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - started_s


async def test_a_client_keeps_its_gateway_present_and_lapses_it_on_close(backend) -> None:
    jobs = JobClient(backend, keep_every_s=0.05, presence_ttl_ms=400)
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    presence = backend.keys.gateway(jobs.gateway_id)
    await jobs.submit_and_wait(build_job(job_id="p1", tier="interactive"))
    assert await redis.hget(backend.keys.job("p1"), "gw") == jobs.gateway_id
    await _until(lambda: _equals(redis.get(presence), "up"), 2.0)
    await asyncio.sleep(0.6)  # past one TTL: renewed meanwhile
    assert await redis.get(presence) == "up"
    assert 0 < await redis.pttl(presence) <= 400
    await jobs.aclose()
    await asyncio.sleep(0.05)
    assert await redis.get(presence) is None  # lapsed at once, not after the TTL
    await redis.aclose()


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected


async def test_a_cancel_the_stalled_queue_missed_lands_once_it_is_back(tmp_path) -> None:
    server = RedisServer(tmp_path / "redis.log")
    server.start()
    # Replies later than this fail the call, as a gateway's client fails them (10 s).
    client = aioredis.Redis.from_url(
        server.url, decode_responses=True, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    try:
        backend = RedisBackend(client)
        await backend.configure_tiers(TIERS)
        jobs = JobClient(backend, keep_every_s=0.1)
        await jobs.submit_and_wait(build_job(job_id="stalled", tier="interactive"))
        server.pause()
        try:
            with pytest.raises(BackendUnavailableError):
                await jobs.cancel("stalled")
            assert jobs.num_pending_cancels == 1
            await asyncio.sleep(1.0)  # rounds go by while Redis stands still
        finally:
            server.resume()
        took_s = await _until(
            lambda: _equals(backend.job_status("stalled"), JobStatus.CANCELLED), 5.0
        )
        print(f"the deferred cancel landed {took_s * 1000:.0f} ms after Redis was back")

        async def none_pending() -> bool:  # the round forgets it once its call returns
            return jobs.num_pending_cancels == 0

        await _until(none_pending, 1.0)
        await jobs.aclose()
    finally:
        await client.aclose()
        server.stop()


async def test_a_request_waiting_on_a_fleet_without_workers_gets_no_capacity() -> None:
    queue = MemoryBackend(TIERS)
    jobs = JobClient(queue, keep_every_s=0.05, no_worker_ms=300)
    waited = await jobs.submit_and_wait(build_job(job_id="waited", tier="interactive"))
    line = jobs.submit(build_job(job_id="line", tier="interactive"))  # a Batch API line
    started_s = time.monotonic()
    with pytest.raises(NoCapacityError):
        async for _ in waited:
            pass
    took_s = time.monotonic() - started_s
    assert 0.3 <= took_s < 2.0
    await _until(lambda: _equals(queue.job_status("waited"), JobStatus.CANCELLED), 2.0)
    # A batch line waits for a worker, however long.
    assert await queue.job_status("line") is JobStatus.QUEUED
    assert not line._ended
    await jobs.aclose()


async def test_a_live_worker_keeps_waiting_requests_waiting() -> None:
    queue = MemoryBackend(TIERS)
    jobs = JobClient(queue, keep_every_s=0.05, no_worker_ms=300)
    await queue.publish_capacity(
        "w1", prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0, ttl_ms=60_000
    )
    waiting = await jobs.submit_and_wait(build_job(job_id="waiting", tier="interactive"))
    await asyncio.sleep(0.8)
    assert not waiting._ended
    assert await queue.job_status("waiting") is JobStatus.QUEUED
    # The worker goes (its report lapses): the grace counts from then, not from the
    # request's arrival.
    await queue.publish_capacity("w1", prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0, ttl_ms=1)
    started_s = time.monotonic()
    with pytest.raises(NoCapacityError):
        async for _ in waiting:
            pass
    assert time.monotonic() - started_s >= 0.3
    await jobs.aclose()


async def test_the_clients_background_loops_run_outside_the_first_jobs_context() -> None:
    """The loops start with the first job, inside its request's context: every line they
    logged afterwards (a deferred cancel landing for another request) carried the first
    request's id."""
    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)
    seen: list[str | None] = []

    class Watched(MemoryBackend):
        async def publish_gateway(self, gateway_id: str, ttl_ms: int) -> None:
            seen.append(request_id.get())  # what a log line written here would carry
            await super().publish_gateway(gateway_id, ttl_ms)

    client = JobClient(Watched([TierConfig("interactive", rank=1)]), keep_every_s=0.01)
    request_id.set("req_first")
    client.submit(build_job())  # the first job starts the loops
    for _ in range(200):
        if len(seen) >= 2:
            break
        await asyncio.sleep(0.01)
    from_the_loop = list(seen)
    await client.aclose()  # its own last presence, in this (the caller's) context
    assert len(from_the_loop) >= 2
    assert set(from_the_loop) == {None}


async def test_a_stream_resumed_by_another_worker_is_paced_from_its_new_lease(backend) -> None:
    """A job's worker went away after 10 tokens and another resumed it a second later.
    The pace of its stream (the fallback of a refusal's Retry-After) is its new run's:
    counted from its first dispatch, the second the stream stood still made it 50 ms a
    token or more."""
    gap_s = 1.0
    jobs = JobClient(backend, poll_ms=100)
    stream = await jobs.submit_and_wait(build_job(job_id="moved", tier="interactive"))

    async def run(worker_id: str, num_received: int) -> None:
        await backend.dispatch(worker_id, 60_000)
        # The lease's queue wait, from the job's arrival, on its first event.
        wait_ms = (time.monotonic() - stream.enqueued_s) * 1000.0
        for step in range(10):
            await backend.publish_step(
                "moved", worker_id, [step], queue_wait_ms=None if step else wait_ms
            )
            await asyncio.sleep(0.002)

        async def received() -> bool:
            return stream.num_output_tokens == num_received

        await _until(received, 5.0)

    try:
        await run("w-gone", 10)
        dispatched_s = stream.dispatched_s
        assert jobs.stream_pace_s() is not None
        await asyncio.sleep(gap_s)
        assert await backend.requeue("moved", worker_id="w-gone")
        await run("w-resumes", 20)
        pace = jobs.stream_pace_s()
        assert pace is not None
        assert pace < gap_s / 20 / 2, pace
        assert stream.dispatched_s == dispatched_s  # its queue wait is its first lease's
        assert stream.run_base_tokens == 10
    finally:
        await jobs.aclose()
