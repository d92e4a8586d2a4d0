"""Usage records: buffered, written in batches off the request path, retried, bounded;
each batch adds to the hourly rollup in its own transaction."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, text

from gateway.db.models import UsageHourly, UsageRow
from gateway.db.session import create_db_engine, create_sessionmaker
from gateway.migrate import upgrade_to_head
from gateway.observability.slo import SloTargets
from gateway.usage import TokenPrices, UsageRecord, UsageWriter

T0 = datetime(2030, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)


def _record(i: int, **fields) -> UsageRecord:
    values = {
        "request_id": f"req_{i}",
        "tenant_id": "ten_a" if i % 2 else "ten_b",
        "tier": "interactive",
        "model": "tiny-random",
        "prompt_tokens": 10 + i,
        "completion_tokens": i,
        "queue_wait_ms": 1.5,
        "ttft_ms": 20.25,
        "e2e_ms": 100.0 + i,
        "outcome": "ok",
        "created_at": T0 + timedelta(seconds=i),
    }
    return UsageRecord(**{**values, **fields})


async def _rows(sessionmaker) -> list[UsageRow]:
    async with sessionmaker() as session:
        return list((await session.scalars(select(UsageRow).order_by(UsageRow.id))).all())


async def test_records_round_trip(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker, flush_interval_s=60)
    await writer.start()
    records = [_record(i) for i in range(7)]
    records.append(_record(7, ttft_ms=None, queue_wait_ms=None, outcome="rejected:slo"))
    for rec in records:
        writer.record(rec)
    assert await _rows(db_sessionmaker) == []  # nothing written on the request path
    await writer.aclose()
    rows = await _rows(db_sessionmaker)
    assert len(rows) == len(records)
    for row, rec in zip(rows, records, strict=True):
        assert row.request_id == rec.request_id
        assert (row.tenant_id, row.tier, row.model) == (rec.tenant_id, rec.tier, rec.model)
        assert (row.prompt_tokens, row.completion_tokens) == (
            rec.prompt_tokens,
            rec.completion_tokens,
        )
        assert (row.queue_wait_ms, row.ttft_ms, row.e2e_ms) == (
            rec.queue_wait_ms,
            rec.ttft_ms,
            rec.e2e_ms,
        )
        assert row.outcome == rec.outcome
        assert row.created_at == rec.created_at
        assert row.created_at.tzinfo is not None
    assert writer.num_written == len(records)


async def test_flushes_on_interval_and_in_batches(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker, flush_interval_s=0.05, max_batch=10)
    await writer.start()
    try:
        started = time.perf_counter()
        for i in range(25):
            writer.record(_record(i))
        # record() only appends: 25 calls take far less than one database round trip.
        assert time.perf_counter() - started < 0.05
        for _ in range(100):
            if writer.num_written == 25:
                break
            await asyncio.sleep(0.02)
        assert len(await _rows(db_sessionmaker)) == 25
        assert writer.num_pending == 0
    finally:
        await writer.aclose()


async def test_database_down_keeps_records_and_retries(database_url) -> None:
    # An empty database (no usage table yet) refuses every insert.
    engine = create_db_engine(database_url)
    sessionmaker = create_sessionmaker(engine)
    try:
        writer = UsageWriter(sessionmaker, max_batch=4)
        for i in range(6):
            writer.record(_record(i))
        assert await writer.flush() is False
        assert await writer.flush() is False  # the same (oldest) batch again, not the next
        assert (writer.num_written, writer.num_pending) == (0, 6)

        await engine.dispose()  # let the migration take the SQLite file
        await asyncio.to_thread(upgrade_to_head, database_url)
        await writer.aclose()
        rows = await _rows(sessionmaker)
        assert [r.request_id for r in rows] == [f"req_{i}" for i in range(6)]
    finally:
        await engine.dispose()


async def test_close_waits_for_the_batch_being_written(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker, flush_interval_s=0.001, max_batch=1)
    await writer.start()
    for i in range(50):
        writer.record(_record(i))
    await asyncio.sleep(0.01)  # the flusher is mid-way through the records
    await writer.aclose()
    rows = await _rows(db_sessionmaker)
    assert sorted(r.request_id for r in rows) == sorted(f"req_{i}" for i in range(50))


async def test_buffer_is_bounded(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker, max_buffered=5)
    for i in range(8):  # never started: nothing drains the buffer
        writer.record(_record(i))
    assert (writer.num_pending, writer.num_dropped) == (5, 3)
    await writer.aclose()
    rows = await _rows(db_sessionmaker)
    assert [r.request_id for r in rows] == [f"req_{i}" for i in range(3, 8)]  # oldest dropped


async def test_record_never_raises_and_odd_records_do_not_block(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker)
    writer.record(None)  # type: ignore[arg-type]  # a caller bug must not fail a request
    assert writer.num_pending == 0
    writer.record(_record(1, model="m" * 1000, outcome="rejected:" + "x" * 100))
    writer.record(_record(2))
    await writer.aclose()
    rows = await _rows(db_sessionmaker)
    assert [r.request_id for r in rows] == ["req_1", "req_2"]
    assert rows[0].model == "m" * 200


_REFUSE_POISON = {
    # A record the database cannot store, whatever the reason (it refused a cost beyond
    # its 64-bit column, before costs were capped): a trigger stands in for the reason.
    "sqlite": [
        "CREATE TRIGGER poison BEFORE INSERT ON usage_records WHEN NEW.request_id = "
        "'req_poison' BEGIN SELECT RAISE(ABORT, 'cannot store this record'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN IF NEW.request_id = "
        "'req_poison' THEN RAISE EXCEPTION 'cannot store this record'; END IF; "
        "RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER poison BEFORE INSERT ON usage_records FOR EACH ROW "
        "EXECUTE FUNCTION poison()",
    ],
}


async def test_a_record_the_database_refuses_is_dropped_not_retried_forever(
    db_sessionmaker,
) -> None:
    async with db_sessionmaker() as session, session.begin():
        for statement in _REFUSE_POISON[session.bind.dialect.name]:
            await session.execute(text(statement))
    settled: list[str] = []
    writer = UsageWriter(db_sessionmaker, max_batch=10, on_written=settled.extend)
    for i in range(3):
        writer.record(_record(i, job_ids=(f"job_{i}",)))
    writer.record(_record(0, request_id="req_poison", job_ids=("job_p",)))
    for i in range(3, 6):
        writer.record(_record(i, job_ids=(f"job_{i}",)))
    # Retried whole, the batch failed forever and every later record waited behind it.
    assert await writer.flush() is True
    assert (writer.num_written, writer.num_dropped, writer.num_pending) == (6, 1, 0)
    assert sorted(settled) == sorted([f"job_{i}" for i in range(6)] + ["job_p"])
    rows = await _rows(db_sessionmaker)
    assert sorted(r.request_id for r in rows) == [f"req_{i}" for i in range(6)]
    # The hourly rollup holds what was written, each record once.
    hourly = await _hourly(db_sessionmaker)
    assert sum(v[0] for v in hourly.values()) == 6
    await writer.aclose()


async def test_a_batch_the_database_takes_none_of_is_kept(db_sessionmaker) -> None:
    # Every record refused, one at a time too (a column the schema lacks, say): nothing
    # tells a record apart from the others, so none is dropped.
    async with db_sessionmaker() as session, session.begin():
        await session.execute(text("ALTER TABLE usage_records RENAME TO usage_records_away"))
    writer = UsageWriter(db_sessionmaker, max_batch=10)
    for i in range(4):
        writer.record(_record(i))
    assert await writer.flush() is False
    assert (writer.num_written, writer.num_dropped, writer.num_pending) == (0, 0, 4)
    async with db_sessionmaker() as session, session.begin():
        await session.execute(text("ALTER TABLE usage_records_away RENAME TO usage_records"))
    await writer.aclose()
    assert [r.request_id for r in await _rows(db_sessionmaker)] == [f"req_{i}" for i in range(4)]


async def test_a_cost_beyond_the_column_is_billed_at_its_most(db_sessionmaker) -> None:
    # A price set before the admin API capped prices (1e12 per million tokens).
    prices = TokenPrices(1e12, 1e12)
    assert prices.cost_nanos(10_000, 0) == 2**63 - 1
    writer = UsageWriter(db_sessionmaker)
    writer.record(_record(1, prompt_tokens=10_000, prices=prices))
    writer.record(_record(2))
    await writer.aclose()
    rows = await _rows(db_sessionmaker)
    assert (rows[0].request_id, rows[0].cost_nanos) == ("req_1", 2**63 - 1)
    assert len(rows) == 2


async def _hourly(sessionmaker) -> dict[tuple, tuple]:
    async with sessionmaker() as session:
        rows = (await session.execute(select(UsageHourly))).scalars().all()
    return {
        (r.hour, r.tenant_id, r.tier): (r.requests, r.input_tokens, r.output_tokens, r.slo_met)
        for r in rows
    }


async def test_batch_and_rollup_are_one_transaction(db_sessionmaker) -> None:
    # No rollup table: the records' insert succeeds, the upsert fails, and the whole
    # batch must roll back so that the retry counts each record exactly once.
    async def rename(old: str, new: str) -> None:
        async with db_sessionmaker() as session, session.begin():
            await session.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))

    writer = UsageWriter(db_sessionmaker, max_batch=10)
    for i in range(4):
        writer.record(_record(i))
    await rename("usage_hourly", "usage_hourly_away")
    assert await writer.flush() is False
    await rename("usage_hourly_away", "usage_hourly")
    assert await _rows(db_sessionmaker) == []
    assert await writer.flush() is True
    hour = T0.replace(minute=0, second=0, microsecond=0)
    assert await _hourly(db_sessionmaker) == {
        (hour, "ten_a", "interactive"): (2, 11 + 13, 1 + 3, 2),
        (hour, "ten_b", "interactive"): (2, 10 + 12, 0 + 2, 2),
    }


async def test_concurrent_writers_add_up(db_sessionmaker) -> None:
    # Two replicas' writers upserting the same hours at once: every record counted once.
    writers = [UsageWriter(db_sessionmaker, max_batch=25) for _ in range(2)]
    for i in range(200):
        writers[i % 2].record(_record(i, created_at=T0 + timedelta(minutes=(i * 7) % 180)))

    async def drain(writer: UsageWriter) -> None:
        while writer.num_pending:
            if not await writer.flush():
                await asyncio.sleep(0.01)  # SQLite: the other writer holds the file

    await asyncio.gather(*(drain(w) for w in writers))
    totals = await _hourly(db_sessionmaker)
    assert sum(count[0] for count in totals.values()) == 200
    assert sum(count[1] for count in totals.values()) == sum(10 + i for i in range(200))
    assert len(totals) == 3 * 2  # three hours, two tenants


async def test_naive_time_is_dropped_not_retried_forever(db_sessionmaker) -> None:
    writer = UsageWriter(db_sessionmaker)
    writer.record(_record(1, created_at=datetime(2030, 1, 1)))
    writer.record(_record(2))
    assert writer.num_pending == 1
    await writer.aclose()
    assert [r.request_id for r in await _rows(db_sessionmaker)] == ["req_2"]


async def test_a_record_is_judged_by_the_slo_its_request_ran_under(db_sessionmaker) -> None:
    # The seeded interactive tier promises a TTFT of 2 s. A record carries the SLO its
    # tier had when the request ran: changed before the write, it still decides.
    writer = UsageWriter(db_sessionmaker, flush_interval_s=60)
    await writer.start()
    writer.record(_record(1, ttft_ms=20.0, slo=SloTargets(ttft_slo_ms=10.0)))  # was tight
    writer.record(_record(2, ttft_ms=5000.0, slo=SloTargets(ttft_slo_ms=10_000.0)))  # loose
    writer.record(_record(3, ttft_ms=5000.0))  # no SLO on record: the tier's at the write
    writer.record(_record(4, ttft_ms=20.0))
    await writer.aclose()
    assert [row.slo_met for row in await _rows(db_sessionmaker)] == [False, True, False, True]
    async with db_sessionmaker() as session:
        met = await session.scalar(select(func.sum(UsageHourly.slo_met)))
    assert met == 2
