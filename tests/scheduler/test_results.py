"""The gateway's end of a job (JobClient, JobStream) on a real Redis, no worker.

A client that goes away while its job is still queued must get its handler back at
once: the job leaves the queue and the stream's reader stops, even when the reader's
cancellation lands where redis-py swallows it (while it takes or opens a connection)
and no result event will ever arrive to end the read.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from engine.errors import RequestAbortedError
from scheduler.backend import JobStatus
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.results import JobClient
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
