"""A gateway bills the requests of a gateway that died before billing them
(gateway.usage_recovery), from what the queue saw served.

Real Redis queue (short graces), real databases (SQLite and PostgreSQL):
jobs are queued by a gateway that then goes away, leased and streamed by a worker, and a
surviving gateway's UsageRecovery writes one usage record per request, unless the dead
gateway wrote one after all.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from sqlalchemy import select

from engine.request import SamplingParams
from gateway.db.models import UsageRow
from gateway.db.session import create_db_engine, create_sessionmaker
from gateway.migrate import upgrade_to_head
from gateway.openai.choices import request_of_job
from gateway.usage import UsageRecord, UsageWriter, write_usage
from gateway.usage_recovery import UsageRecovery
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.results import JobClient
from tests.conftest import REDIS_URL

# The graces run on Redis's clock: short ones here.
GATEWAY_GRACE_MS = 200
BILL_GRACE_MS = 600
LEASE_MS = 5_000
MODEL = "tiny-random"


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
async def queue(redis_prefix: str):
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    clock = Clock()
    backend = RedisBackend(
        client,
        keys=KeySpace(redis_prefix),
        clock_ms=clock,
        gateway_grace_ms=GATEWAY_GRACE_MS,
        bill_grace_ms=BILL_GRACE_MS,
    )
    await backend.configure_tiers([TierConfig("interactive", rank=1)])
    yield backend
    await backend.aclose()


def _job(job_id: str, tenant: str, bill: int | None, num_prompt_tokens: int = 6) -> Job:
    return Job(
        job_id=job_id,
        tenant_id=tenant,
        tier="interactive",
        rank=1,
        weight=1.0,
        prompt_token_ids=tuple(range(1, num_prompt_tokens + 1)),
        params=SamplingParams(max_tokens=16),
        arrival_s=1_700_000_000.0,
        bill_prompt_tokens=bill,
    )


async def _dead_gateway_served(backend: RedisBackend) -> None:
    """What a gateway that died left: a request of two choices that finished, one cut off
    after a step, one leased that never stepped, one whose record it wrote before dying,
    and one still queued."""
    jobs = [
        _job("chatcmpl-a", "t1", 6),
        _job("chatcmpl-a.1", "t1", 0),
        _job("cmpl-b", "t2", 6),
        _job("cmpl-c", "t1", 6),
        _job("cmpl-d", "t2", 6),
    ]
    for job in jobs:
        await backend.enqueue(job, gateway_id="gw-dead")
    assert len(await backend.dispatch_many("w1", LEASE_MS, len(jobs))) == len(jobs)
    await backend.enqueue(_job("cmpl-e", "t1", 6), gateway_id="gw-dead")
    await backend.publish_step("chatcmpl-a", "w1", [5, 6, 7], queue_wait_ms=40.0)
    await backend.publish_step("chatcmpl-a", "w1", [8], finish_reason="stop")
    await backend.publish_step("chatcmpl-a.1", "w1", [9, 9], queue_wait_ms=45.0)
    await backend.publish_step("chatcmpl-a.1", "w1", [], finish_reason="length")
    await backend.publish_step("cmpl-b", "w1", [1, 2], queue_wait_ms=10.0)
    await backend.publish_step("cmpl-c", "w1", [3], queue_wait_ms=5.0, finish_reason="stop")
    # Its presence lapses, is seen so, and the billing grace passes; the worker's next
    # renewals find its jobs abandoned.
    await backend.publish_gateway("gw-dead", 20)
    await asyncio.sleep(0.06)
    assert await backend.claim_unbilled("gw-alive") == []
    await asyncio.sleep(BILL_GRACE_MS / 1000 + 0.05)
    for job_id in ("cmpl-b", "cmpl-d"):
        assert not await backend.renew("w1", job_id, LEASE_MS)


def _own_record(request_id: str, job_ids: tuple[str, ...] = ()) -> UsageRecord:
    """A record as the gateway that queued the request writes it."""
    return UsageRecord(
        request_id=request_id,
        tenant_id="t1",
        tier="interactive",
        model=MODEL,
        prompt_tokens=6,
        completion_tokens=1,
        queue_wait_ms=5.0,
        ttft_ms=9.0,
        e2e_ms=9.0,
        outcome="ok",
        created_at=datetime.now(UTC),
        job_ids=job_ids,
    )


async def _rows(sessionmaker) -> dict[str, UsageRow]:
    async with sessionmaker() as session:
        rows = (await session.scalars(select(UsageRow))).all()
    by_request = {row.request_id: row for row in rows}
    assert len(by_request) == len(rows), "a request billed twice"
    return by_request


async def test_the_requests_of_a_dead_gateway_are_billed_once(queue, db_sessionmaker) -> None:
    backend = queue
    await _dead_gateway_served(backend)
    # The dead gateway wrote cmpl-c's record before it died (but never settled it).
    async with db_sessionmaker() as session, session.begin():
        await write_usage(session, [_own_record("cmpl-c")])

    usage = UsageWriter(db_sessionmaker)
    recovery = UsageRecovery(backend, "gw-alive", usage, db_sessionmaker, model=MODEL)
    assert await recovery.run_once() == 5  # every job that left the queue and ended
    assert await usage.flush()
    assert await recovery.run_once() == 0  # claimed once
    rows = await _rows(db_sessionmaker)
    assert sorted(rows) == ["chatcmpl-a", "cmpl-b", "cmpl-c", "cmpl-d"]
    assert recovery.num_recovered == 3
    a, b, c, d = (rows[i] for i in ("chatcmpl-a", "cmpl-b", "cmpl-c", "cmpl-d"))
    # Two choices, the prompt once, every token streamed; ended as they should have.
    assert (a.tenant_id, a.model, a.outcome, a.prompt_tokens, a.completion_tokens) == (
        "t1",
        MODEL,
        "ok",
        6,
        6,
    )
    assert (a.num_choices, a.longest_choice_tokens, a.queue_wait_ms) == (2, 4, 40.0)
    assert a.ttft_ms is not None
    assert 40.0 <= a.ttft_ms < 5_000
    assert a.e2e_ms >= a.ttft_ms
    assert a.slo_met is not None
    # Cut off after a step: its prompt and what was streamed, as an aborted request.
    assert (b.tenant_id, b.outcome, b.prompt_tokens, b.completion_tokens) == (
        "t2",
        "aborted",
        6,
        2,
    )
    # Its record was written: left alone.
    assert (c.ttft_ms, c.e2e_ms) == (9.0, 9.0)
    # Leased but never stepped: no prompt billed (as a request that had not left the
    # queue), nothing streamed.
    assert (d.outcome, d.prompt_tokens, d.completion_tokens, d.queue_wait_ms) == (
        "aborted",
        0,
        0,
        None,
    )


async def test_a_gateway_that_was_only_stopped_leaves_out_what_another_billed(
    queue, db_sessionmaker
) -> None:
    backend = queue
    await _dead_gateway_served(backend)
    survivor = UsageWriter(db_sessionmaker)
    recovery = UsageRecovery(backend, "gw-alive", survivor, db_sessionmaker, model=MODEL)
    assert await recovery.run_once() == 5
    assert await survivor.flush()
    # The "dead" gateway was only stopped (SIGSTOP, a long pause): back, it writes the
    # records of its requests as they ended for its clients.
    back = JobClient(backend, gateway_id="gw-dead")
    settled: list[str] = []
    usage = UsageWriter(
        db_sessionmaker, on_written=settled.extend, claimed_elsewhere=back.claimed_elsewhere
    )
    usage.record(_own_record("chatcmpl-a", ("chatcmpl-a", "chatcmpl-a.1")))
    usage.record(_own_record("cmpl-e", ("cmpl-e",)))  # never left the queue: not claimed
    try:
        assert await usage.flush()
    finally:
        await back.aclose()
    rows = await _rows(db_sessionmaker)
    # Billed once each: chatcmpl-a by the survivor (what its streams held), cmpl-e by its
    # own gateway; all three jobs are settled.
    assert (usage.num_written, usage.num_billed_elsewhere) == (1, 1)
    assert (rows["chatcmpl-a"].completion_tokens, rows["cmpl-e"].completion_tokens) == (6, 1)
    assert sorted(settled) == ["chatcmpl-a", "chatcmpl-a.1", "cmpl-e"]
    # Its presence was renewed before it wrote: no claim can start meanwhile.
    assert await backend.claim_unbilled("gw-alive") == []


async def test_claims_wait_for_a_database_that_cannot_answer(queue, tmp_path: Path) -> None:
    backend = queue
    await _dead_gateway_served(backend)
    # A database without its tables yet: the check for records already written fails.
    path = tmp_path / "late.db"
    sqlite3.connect(path).close()
    url = f"sqlite+aiosqlite:///{path}"
    engine = create_db_engine(url)
    sessionmaker = create_sessionmaker(engine)
    try:
        usage = UsageWriter(sessionmaker)
        recovery = UsageRecovery(backend, "gw-alive", usage, sessionmaker, model=MODEL)
        with pytest.raises(Exception, match="usage_records"):
            await recovery.run_once()
        assert usage.num_pending == 0  # nothing billed without the check
        await asyncio.to_thread(upgrade_to_head, url)
        assert await recovery.run_once() == 0  # nothing more to claim, the rest billed
        assert await usage.flush()
        assert sorted(await _rows(sessionmaker)) == ["chatcmpl-a", "cmpl-b", "cmpl-c", "cmpl-d"]
    finally:
        await engine.dispose()


def test_a_choice_job_belongs_to_its_request() -> None:
    assert request_of_job("chatcmpl-1f2e.3") == "chatcmpl-1f2e"
    assert request_of_job("chatcmpl-1f2e") == "chatcmpl-1f2e"
    assert request_of_job("req.v2") == "req.v2"  # a dot that is not a choice's


def test_a_live_request_bills_each_prompt_once() -> None:
    from gateway.openai.choices import RequestPlan, choice_jobs

    jobs = [
        *choice_jobs(_job("cmpl-x", "t", None, 6), 2),
        *choice_jobs(_job("cmpl-x", "t", None, 4), 2, first_index=2),
    ]
    plan = RequestPlan(jobs, 2, [6, 4], None).billed_by_queue()
    assert [(j.job_id, j.bill_prompt_tokens) for j in plan.jobs] == [
        ("cmpl-x", 6),
        ("cmpl-x.1", 0),
        ("cmpl-x.2", 4),
        ("cmpl-x.3", 0),
    ]
    assert plan.num_prompt_tokens == 10
    # Not part of what a worker reads.
    assert "bill_prompt_tokens" not in plan.jobs[0].to_json()
