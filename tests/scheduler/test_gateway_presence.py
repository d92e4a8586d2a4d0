"""A job whose gateway went away is abandoned, not run for nobody (the Redis queue).

Each gateway keeps a presence key with a TTL (`publish_gateway`); the queue checks a
job's gateway where it hands the job to a worker (dispatch), keeps it there (renew) or
gives it back (reclaim), and abandons the job once the presence has been seen lapsed
for the grace: finished as cancelled, with a `gateway_lost` error event. Real Redis;
the presence lapses by Redis's own clock, and the grace runs on it too (real time, a
fraction of a second here); the leases run on the queue's clock (a fake one).
"""

from __future__ import annotations

import asyncio

import pytest

from scheduler.backend import GATEWAY_LOST, EventKind, JobStatus, QueueTotals
from scheduler.redis_backend import RedisBackend

from .conftest import TIERS

LEASE_MS = 5_000
GRACE_MS = 400
SHORT_TTL_MS = 30
LONG_TTL_MS = 60_000


@pytest.fixture
async def queue(redis_client, keys, clock) -> RedisBackend:
    backend = RedisBackend(redis_client, keys=keys, clock_ms=clock, gateway_grace_ms=GRACE_MS)
    await backend.configure_tiers(TIERS)
    return backend


async def _lapse(queue: RedisBackend, gateway_id: str) -> None:
    """The gateway stops renewing its presence (it died, or Redis stood still)."""
    await queue.publish_gateway(gateway_id, SHORT_TTL_MS)
    await asyncio.sleep(3 * SHORT_TTL_MS / 1000)


async def _grace_passes() -> None:
    await asyncio.sleep(GRACE_MS / 1000 + 0.05)


async def _events(queue: RedisBackend, job_id: str) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.code) async for e in queue.results(job_id)]


async def test_a_running_job_of_a_gone_gateway_is_abandoned_at_its_renewal(
    queue, make_job, clock
) -> None:
    await queue.publish_gateway("gw-a", LONG_TTL_MS)
    await queue.enqueue(make_job("t", job_id="j1"), gateway_id="gw-a")
    assert (await queue.dispatch("w1", LEASE_MS)).job_id == "j1"
    assert await queue.publish_tokens("j1", "w1", [5])
    assert await queue.renew("w1", "j1", LEASE_MS)
    await _lapse(queue, "gw-a")
    assert await queue.renew("w1", "j1", LEASE_MS)  # first seen lapsed: the grace starts
    assert await queue.renew("w1", "j1", LEASE_MS)
    await _grace_passes()
    assert not await queue.renew("w1", "j1", LEASE_MS)  # the worker stops it
    assert await queue.job_status("j1") is JobStatus.CANCELLED
    assert not await queue.publish_tokens("j1", "w1", [6])
    assert await _events(queue, "j1") == [(EventKind.TOKENS, ""), (EventKind.ERROR, GATEWAY_LOST)]
    assert await queue.totals() == QueueTotals(abandoned=1)
    assert await queue.depth() == {}


async def test_a_gateway_back_within_the_grace_keeps_its_jobs(queue, make_job, clock) -> None:
    # What a paused Redis looks like: every presence lapsed, then renewed at once.
    await queue.enqueue(make_job("t", job_id="j1"), gateway_id="gw-a")
    await queue.dispatch("w1", LEASE_MS)
    await _lapse(queue, "gw-a")
    assert await queue.renew("w1", "j1", LEASE_MS)
    await queue.publish_gateway("gw-a", LONG_TTL_MS)
    await _grace_passes()
    assert await queue.renew("w1", "j1", LEASE_MS)
    # A later lapse is timed afresh, not from the first one (longer ago than the grace).
    await _lapse(queue, "gw-a")
    assert await queue.renew("w1", "j1", LEASE_MS)
    assert await queue.renew("w1", "j1", LEASE_MS)
    assert await queue.job_status("j1") is JobStatus.LEASED
    assert await queue.totals() == QueueTotals()


async def test_a_check_that_waited_out_a_stall_does_not_shorten_the_grace(
    queue, make_job, clock
) -> None:
    # A renewal sent while Redis stood still reaches it with a now_ms seconds old. It is
    # the first to find the presence lapsed, and the grace still counts from when Redis
    # ran it: the gateway's own renewal, a moment behind, keeps its jobs. (Timed by the
    # callers' clocks, the next renewal abandoned them.)
    await queue.enqueue(make_job("t", job_id="j1"), gateway_id="gw-a")
    await queue.dispatch("w1", LEASE_MS)
    await _lapse(queue, "gw-a")
    clock.advance(-10 * GRACE_MS)
    assert await queue.renew("w1", "j1", LEASE_MS)
    clock.advance(10 * GRACE_MS)
    assert await queue.renew("w1", "j1", LEASE_MS)
    await queue.publish_gateway("gw-a", LONG_TTL_MS)
    await _grace_passes()
    assert await queue.renew("w1", "j1", LEASE_MS)
    assert await queue.job_status("j1") is JobStatus.LEASED
    assert await queue.totals() == QueueTotals()


async def test_dispatch_abandons_the_queued_jobs_of_a_gone_gateway(queue, make_job, clock) -> None:
    await queue.publish_gateway("gw-live", LONG_TTL_MS)
    await queue.enqueue(make_job("t", job_id="running"), gateway_id="gw-dead")
    assert (await queue.dispatch("w1", LEASE_MS)).job_id == "running"
    await queue.enqueue(make_job("t", job_id="orphan-1"), gateway_id="gw-dead")
    await queue.enqueue(make_job("t", job_id="orphan-2"), gateway_id="gw-dead")
    await queue.enqueue(make_job("t", job_id="live"), gateway_id="gw-live")
    await queue.enqueue(make_job("t", job_id="anonymous"))  # no gateway: never abandoned
    await _lapse(queue, "gw-dead")
    assert await queue.renew("w1", "running", LEASE_MS)  # seen lapsed
    await _grace_passes()
    leased = await queue.dispatch_many("w2", LEASE_MS, 2)
    assert [job.job_id for job in leased] == ["live", "anonymous"]
    for job_id in ("orphan-1", "orphan-2"):
        assert await queue.job_status(job_id) is JobStatus.CANCELLED
        assert await _events(queue, job_id) == [(EventKind.ERROR, GATEWAY_LOST)]
    assert not await queue.renew("w1", "running", LEASE_MS)
    assert await queue.totals() == QueueTotals(abandoned=3)
    assert await queue.depth() == {}
    assert await queue.dispatch("w2", LEASE_MS) is None


async def test_reclaim_abandons_the_expired_leases_of_a_gone_gateway(
    queue, make_job, clock
) -> None:
    await queue.enqueue(make_job("t", job_id="orphan"), gateway_id="gw-dead")
    await queue.enqueue(make_job("t", job_id="kept"))
    await queue.dispatch_many("dead-worker", LEASE_MS, 2)
    await _lapse(queue, "gw-dead")
    assert await queue.renew("dead-worker", "orphan", LEASE_MS)  # seen lapsed, then the
    clock.advance(LEASE_MS)  # worker dies too: both leases run out
    await _grace_passes()
    assert await queue.reclaim_expired_leases() == ["kept"]
    assert await queue.job_status("orphan") is JobStatus.CANCELLED
    assert await queue.job_status("kept") is JobStatus.QUEUED
    assert await queue.totals() == QueueTotals(lease_expirations=2, abandoned=1)
