"""The served jobs of a gateway that died before billing them are claimed, once, by
another gateway (the Redis queue; QueueBackend.settle and claim_unbilled).

A gateway queues each live request's jobs with the prompt tokens they bill
(Job.bill_prompt_tokens) and settles them once it has written their usage record. Once
its presence has lapsed for the billing grace, another gateway claims the jobs it never
settled that have ended, with what their result streams show served. Real Redis; the
presence lapses by Redis's clock, and the graces run on it too (real time: short ones
here); the leases run on the queue's clock (a fake one).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from scheduler.backend import JobStatus
from scheduler.memory_backend import MemoryBackend
from scheduler.redis_backend import RedisBackend

from .conftest import TIERS

LEASE_MS = 5_000
GRACE_MS = 200  # abandoning a gone gateway's jobs
BILL_GRACE_MS = 600  # billing them
LONG_TTL_MS = 60_000


@pytest.fixture
async def queue(redis_client, keys, clock) -> RedisBackend:
    backend = RedisBackend(
        redis_client,
        keys=keys,
        clock_ms=clock,
        gateway_grace_ms=GRACE_MS,
        bill_grace_ms=BILL_GRACE_MS,
    )
    await backend.configure_tiers(TIERS)
    return backend


def _billed(make_job, job_id: str, prompt: int | None = 10, tenant: str = "t"):
    return replace(make_job(tenant, job_id=job_id), bill_prompt_tokens=prompt)


async def _gone(queue: RedisBackend, gateway_id: str) -> None:
    """The gateway's presence lapses and is seen so: its graces start."""
    await queue.publish_gateway(gateway_id, 20)
    await asyncio.sleep(0.06)
    assert await queue.claim_unbilled("gw-biller") == []


async def _bill_grace_passes() -> None:
    await asyncio.sleep(BILL_GRACE_MS / 1000 + 0.05)


async def test_the_ended_jobs_a_gone_gateway_never_settled_are_claimed_once(
    queue, make_job, clock, redis_client, keys
) -> None:
    await queue.publish_gateway("gw-live", LONG_TTL_MS)
    for job_id in ("done", "partial", "settled", "running"):
        await queue.enqueue(_billed(make_job, job_id), gateway_id="gw-dead")
    await queue.enqueue(_billed(make_job, "done.1", prompt=0), gateway_id="gw-dead")
    await queue.enqueue(_billed(make_job, "batch-line", prompt=None), gateway_id="gw-dead")
    await queue.enqueue(_billed(make_job, "live"), gateway_id="gw-live")
    leased = await queue.dispatch_many("w1", LEASE_MS, 7)
    assert len(leased) == 7
    await queue.enqueue(_billed(make_job, "never-ran"), gateway_id="gw-dead")
    assert await redis_client.hget(keys.job("done"), "bp") == "10"
    assert await redis_client.hget(keys.job("batch-line"), "bp") is None

    # "done" and its second choice stream and finish; "partial" streams one step.
    assert await queue.publish_step("done", "w1", [5, 6], queue_wait_ms=12.0)
    assert await queue.publish_step("done", "w1", [7], finish_reason="stop")
    assert await queue.publish_step("done.1", "w1", [8], queue_wait_ms=14.0, finish_reason="length")
    assert await queue.publish_step("partial", "w1", [9], queue_wait_ms=20.0)
    for job_id in ("settled", "batch-line", "live"):
        await queue.complete(job_id, worker_id="w1")
    await queue.settle("gw-dead", ["settled", "not-a-job"])

    await _gone(queue, "gw-dead")
    assert await queue.claim_unbilled("gw-biller") == []  # not gone long enough
    await _bill_grace_passes()
    # A gateway never claims its own jobs, however its presence looks.
    assert await queue.claim_unbilled("gw-dead") == []
    assert not await queue.renew("w1", "partial", LEASE_MS)  # abandoned: cancelled
    claimed = {job.job_id: job for job in await queue.claim_unbilled("gw-biller")}
    # "running" is leased and not yet abandoned: left for a later claim; "never-ran"
    # served nothing and is dropped unbilled; "settled", "batch-line" and "live" were
    # never the biller's to take.
    assert sorted(claimed) == ["done", "done.1", "partial"]
    done, second, partial = claimed["done"], claimed["done.1"], claimed["partial"]
    assert (done.status, done.prompt_tokens, done.output_tokens) == (JobStatus.DONE, 10, 3)
    assert (second.status, second.prompt_tokens, second.output_tokens) == (JobStatus.DONE, 0, 1)
    assert (partial.status, partial.prompt_tokens, partial.output_tokens) == (
        JobStatus.CANCELLED,
        10,
        1,
    )
    assert (done.tenant_id, done.tier, done.queue_wait_ms) == ("t", "interactive", 12.0)
    # Times from the result stream: the first event is the first token, 12 ms after the
    # job's arrival as its lease measured it; the last is the done event.
    assert done.first_token_ms is not None
    assert done.ended_ms is not None
    assert done.arrival_ms == done.first_token_ms - 12
    assert done.first_token_ms <= done.ended_ms

    assert await queue.claim_unbilled("gw-biller") == []  # each is claimed once
    assert not await queue.renew("w1", "running", LEASE_MS)
    [running] = await queue.claim_unbilled("gw-biller")
    assert (running.job_id, running.status, running.output_tokens) == (
        "running",
        JobStatus.CANCELLED,
        0,
    )
    # No first step came: no queue wait, which the biller reads as its prompt unserved.
    assert (running.queue_wait_ms, running.arrival_ms, running.first_token_ms) == (None,) * 3
    # Nothing of the gone gateway is left; the live one's set stays until it settles.
    assert not await redis_client.exists(keys.unbilled("gw-dead"))
    assert await redis_client.smembers(keys.billing) == {"gw-live"}
    await queue.settle("gw-live", ["live"])
    assert not await redis_client.exists(keys.unbilled("gw-live"))


async def test_a_requeued_job_of_a_gone_gateway_waits_until_it_ends(queue, make_job, clock) -> None:
    # Its worker died after a step: it is queued again, with served work to bill.
    await queue.enqueue(_billed(make_job, "resumed"), gateway_id="gw-dead")
    await queue.dispatch("w1", LEASE_MS)
    assert await queue.publish_step("resumed", "w1", [4, 4], queue_wait_ms=3.0)
    assert await queue.requeue("resumed", worker_id="w1")
    await _gone(queue, "gw-dead")
    await _bill_grace_passes()
    assert await queue.claim_unbilled("gw-biller") == []
    assert await queue.dispatch("w2", LEASE_MS) is None  # abandoned, not run for nobody
    [resumed] = await queue.claim_unbilled("gw-biller")
    assert (resumed.status, resumed.prompt_tokens, resumed.output_tokens) == (
        JobStatus.CANCELLED,
        10,
        2,
    )


async def test_the_claim_is_bounded_and_resumes_where_it_stopped(queue, make_job, clock) -> None:
    ids = [f"r{i}" for i in range(7)]
    for job_id in ids:
        await queue.enqueue(_billed(make_job, job_id), gateway_id="gw-dead")
    await queue.dispatch_many("w1", LEASE_MS, len(ids))
    for job_id in ids:
        await queue.publish_step(job_id, "w1", [1], queue_wait_ms=1.0, finish_reason="stop")
    await _gone(queue, "gw-dead")
    await _bill_grace_passes()
    first = await queue.claim_unbilled("gw-biller", limit=3)
    second = await queue.claim_unbilled("gw-biller", limit=3)
    third = await queue.claim_unbilled("gw-biller", limit=3)
    assert [len(first), len(second), len(third)] == [3, 3, 1]
    assert sorted(j.job_id for j in first + second + third) == ids


async def test_the_in_memory_queue_has_nothing_to_claim(make_job) -> None:
    # Its gateway is its own process: no gateway can die and leave it running.
    queue = MemoryBackend()
    await queue.configure_tiers(TIERS)
    await queue.enqueue(_billed(make_job, "j"), gateway_id="gw")
    await queue.settle("gw", ["j"])
    assert await queue.claim_unbilled("other") == []
