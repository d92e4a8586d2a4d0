"""The hourly rollup: /admin/v1/usage from usage_hourly plus the edges of usage_records
equals the sums over usage_records alone and an independent Python computation, on
random data and random ranges, on SQLite and PostgreSQL; migration 0005 backfills it and
rebuild_usage_rollup repairs hours written without it."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import func, select, update

from gateway.admin.usage_report import (
    UsageLine,
    UsageQuery,
    usage_report,
    usage_report_from_records,
)
from gateway.db.models import Tier, UsageHourly, UsageRow, UTCDateTime
from gateway.db.session import create_db_engine, create_sessionmaker
from gateway.migrate import current_revision, downgrade_to, migrate_to, upgrade_to_head
from gateway.usage import TokenPrices, UsageRecord, UsageWriter, rebuild_usage_rollup

START = datetime(2025, 6, 1, 0, 0, tzinfo=UTC)
SPAN = timedelta(days=3)
TENANTS = ("ten_a", "ten_b", "ten_c", "Ten_d")


@dataclass(frozen=True)
class TierTerms:
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    price_in: float
    price_out: float


# "legacy" has no tiers row (deleted since): no SLO is checked and the price is 0.
TERMS = {
    "priority": TierTerms(500.0, 50.0, 3.0, 15.0),
    "interactive": TierTerms(None, 30.0, 1.0, 5.0),  # a TPOT limit only
    "batch": TierTerms(None, None, 0.25, 1.25),
    "legacy": TierTerms(None, None, 0.0, 0.0),
}
OUTCOMES = ("ok",) * 7 + ("error", "aborted", "rejected:rate_limit_exceeded", "rejected:slo")


async def _set_tier_terms(sessionmaker) -> None:
    async with sessionmaker() as session, session.begin():
        for name, terms in TERMS.items():
            await session.execute(
                update(Tier)
                .where(Tier.name == name)
                .values(
                    ttft_slo_ms=terms.ttft_slo_ms,
                    tpot_slo_ms=terms.tpot_slo_ms,
                    price_input_per_mtok=terms.price_in,
                    price_output_per_mtok=terms.price_out,
                )
            )


def random_records(
    rng: random.Random, count: int, *, choices: tuple[int, ...] = (1, 1, 1, 2, 4)
) -> list[UsageRecord]:
    """Random records; `choices`: the values of num_choices to draw from."""
    records = []
    for i in range(count):
        if rng.random() < 0.05:  # exactly on an hour boundary
            at = START + timedelta(hours=rng.randrange(int(SPAN.total_seconds() // 3600)))
        else:
            at = START + timedelta(microseconds=rng.randrange(int(SPAN.total_seconds() * 1e6)))
        num_choices = rng.choice(choices)
        choice_tokens = [rng.choice((0, 1, 2, 3, 40)) for _ in range(num_choices)]
        num_out = sum(choice_tokens)
        ttft_ms = None if rng.random() < 0.1 else rng.uniform(0, 1000)
        decode_ms = rng.uniform(-5, 60 * max(num_out, 1))  # below 0: clocks disagree
        outcome = rng.choice(OUTCOMES)
        # Requests that never left the queue: refused, or failed or aborted while queued.
        never_ran = outcome.startswith("rejected:") or (outcome != "ok" and rng.random() < 0.3)
        records.append(
            UsageRecord(
                request_id=f"req_{i}",
                tenant_id=rng.choice(TENANTS),
                tier=rng.choice(tuple(TERMS)),
                model="tiny-random",
                prompt_tokens=rng.randrange(2000),
                completion_tokens=num_out,
                queue_wait_ms=None if never_ran else rng.uniform(0, 100),
                ttft_ms=ttft_ms,
                e2e_ms=(ttft_ms or 0.0) + decode_ms,
                outcome=outcome,
                created_at=at,
                num_choices=num_choices,
                longest_choice_tokens=max(choice_tokens) if num_choices > 1 else None,
            )
        )
    return records


def is_met(rec: UsageRecord) -> bool:
    """ARCHITECTURE.md's definition, written out independently of the code under test."""
    terms = TERMS[rec.tier]
    if rec.outcome != "ok":
        return False
    if terms.ttft_slo_ms is not None and (rec.ttft_ms is None or rec.ttft_ms > terms.ttft_slo_ms):
        return False
    # The choices decode side by side: the longest one spans the request.
    num_out = rec.completion_tokens if rec.num_choices == 1 else rec.longest_choice_tokens
    if terms.tpot_slo_ms is None or rec.ttft_ms is None or num_out < 2:
        return True
    tpot_ms = max(0.0, rec.e2e_ms - rec.ttft_ms) / (num_out - 1)
    return tpot_ms <= terms.tpot_slo_ms


def expected_lines(records: list[UsageRecord], query: UsageQuery) -> dict[tuple, UsageLine]:
    sums: dict[tuple, list[int]] = {}
    for rec in records:
        if not (query.start <= rec.created_at < query.end):
            continue
        if query.tenant_id not in (None, rec.tenant_id) or query.tier not in (None, rec.tier):
            continue
        period = rec.created_at.replace(minute=0, second=0, microsecond=0)
        if query.group_by == "day":
            period = period.replace(hour=0)
        counts = sums.setdefault((period, rec.tenant_id, rec.tier), [0] * 6)
        is_refused = rec.outcome.startswith("rejected:")
        counts[0] += 1
        counts[1] += is_refused
        counts[2] += rec.outcome == "aborted"
        # A prompt is billed once served: admitted, and out of the queue.
        counts[3] += 0 if is_refused or rec.queue_wait_ms is None else rec.prompt_tokens
        counts[4] += 0 if is_refused else rec.completion_tokens
        counts[5] += is_met(rec)
    lines = {}
    for key, (requests, refusals, aborted, num_in, num_out, met) in sums.items():
        terms = TERMS[key[2]]
        cost = (num_in * terms.price_in + num_out * terms.price_out) / 1_000_000
        lines[key] = UsageLine(*key, requests, refusals, aborted, num_in, num_out, met, cost)
    return lines


def random_queries(rng: random.Random, count: int) -> list[UsageQuery]:
    def instant() -> datetime:
        hours = rng.randrange(-2, int(SPAN.total_seconds() // 3600) + 2)
        at = START + timedelta(hours=hours)
        if rng.random() < 0.6:  # mostly inside an hour, sometimes on its boundary
            at += timedelta(microseconds=rng.randrange(3_600_000_000))
        return at

    whole = UsageQuery(START - timedelta(hours=1), START + SPAN + timedelta(hours=1), "day")
    queries = [
        whole,
        UsageQuery(START + timedelta(minutes=10), START + timedelta(minutes=50)),  # in an hour
        UsageQuery(START + timedelta(hours=5), START + timedelta(hours=6)),  # exactly one
        UsageQuery(START + timedelta(hours=5), START + timedelta(hours=7, seconds=1)),
        UsageQuery(START + timedelta(hours=5, microseconds=1), START + timedelta(hours=7)),
    ]
    while len(queries) < count:
        start, end = sorted((instant(), instant()))
        if start == end:
            continue
        queries.append(
            UsageQuery(
                start,
                end,
                rng.choice(("hour", "day")),
                tenant_id=rng.choice((None, None, *TENANTS)),
                tier=rng.choice((None, None, None, *TERMS)),
            )
        )
    return queries


async def _write(sessionmaker, records: list[UsageRecord], *, max_batch: int) -> None:
    writer = UsageWriter(sessionmaker, max_batch=max_batch)
    for rec in records:
        writer.record(rec)
    await writer.aclose()
    assert writer.num_written == len(records)


async def _assert_reports_agree(sessionmaker, records, queries) -> None:
    for query in queries:
        from_rollup = await usage_report(sessionmaker, query)
        from_records = await usage_report_from_records(sessionmaker, query)
        assert from_rollup == from_records, query
        expected = expected_lines(records, query)
        assert {(x.period_start, x.tenant_id, x.tier): x for x in from_rollup} == expected, query


async def test_rollup_report_equals_raw_aggregation_on_random_data(db_sessionmaker) -> None:
    rng = random.Random(20250601)
    await _set_tier_terms(db_sessionmaker)
    records = random_records(rng, 1500)
    rng.shuffle(records)  # batches revisit hours that earlier batches already upserted
    await _write(db_sessionmaker, records, max_batch=97)

    async with db_sessionmaker() as session:
        num_buckets = await session.scalar(select(func.count()).select_from(UsageHourly))
        stored = dict((await session.execute(select(UsageRow.request_id, UsageRow.slo_met))).all())
    # One row per (hour, tenant, tier): later batches added to the rows of earlier ones.
    assert num_buckets == len({(_hour(rec), rec.tenant_id, rec.tier) for rec in records})
    assert stored == {rec.request_id: is_met(rec) for rec in records}
    await _assert_reports_agree(db_sessionmaker, records, random_queries(rng, 40))


async def test_slo_met_is_decided_when_written(db_sessionmaker) -> None:
    await _set_tier_terms(db_sessionmaker)
    first = UsageRecord("req_1", "ten_a", "priority", "m", 10, 11, 1.0, 400.0, 800.0, "ok", START)
    await _write(db_sessionmaker, [first], max_batch=10)
    async with db_sessionmaker() as session, session.begin():
        await session.execute(update(Tier).where(Tier.name == "priority").values(ttft_slo_ms=300))
    later = UsageRecord("req_2", "ten_a", "priority", "m", 10, 11, 1.0, 400.0, 800.0, "ok", START)
    await _write(db_sessionmaker, [later], max_batch=10)

    query = UsageQuery(START - timedelta(hours=1), START + timedelta(hours=1))
    (line,) = await usage_report(db_sessionmaker, query)
    # The first met the SLO of its day; the tightened SLO applies from then on only.
    assert (line.requests, line.slo_met) == (2, 1)
    assert await usage_report_from_records(db_sessionmaker, query) == [line]


async def test_a_request_is_priced_at_its_tiers_prices_when_it_ran(db_sessionmaker) -> None:
    await _set_tier_terms(db_sessionmaker)
    # A request made at the tier's prices of then (as the gateway records it), and one
    # recorded without them: priced at the tier's prices when written.
    ran = UsageRecord(
        "req_1",
        "ten_a",
        "batch",
        "m",
        1_000,
        100,
        1.0,
        400.0,
        800.0,
        "ok",
        START,
        prices=TokenPrices(2.0, 8.0),
    )
    unpriced = UsageRecord(
        "req_2", "ten_a", "batch", "m", 1_000, 100, 1.0, 400.0, 800.0, "ok", START
    )
    await _write(db_sessionmaker, [ran, unpriced], max_batch=10)
    query = UsageQuery(START - timedelta(hours=1), START + timedelta(hours=1))
    expected = (1_000 * 2.0 + 100 * 8.0 + 1_000 * 0.25 + 100 * 1.25) / 1e6
    (line,) = await usage_report(db_sessionmaker, query)
    assert line.cost == pytest.approx(expected, abs=1e-12)
    # Re-pricing the tier, or deleting it, leaves what was billed as it was.
    async with db_sessionmaker() as session, session.begin():
        await session.execute(
            update(Tier).where(Tier.name == "batch").values(price_output_per_mtok=1_000.0)
        )
    assert await usage_report(db_sessionmaker, query) == [line]
    async with db_sessionmaker() as session, session.begin():
        await session.execute(sa.delete(Tier).where(Tier.name == "batch"))
    assert await usage_report(db_sessionmaker, query) == [line]
    assert await usage_report_from_records(db_sessionmaker, query) == [line]
    # The rebuild keeps the prices the records were written with.
    async with db_sessionmaker() as session, session.begin():
        await rebuild_usage_rollup(session, query.start, query.end)
    assert await usage_report(db_sessionmaker, query) == [line]


async def test_costs_beyond_a_64_bit_sum_saturate_and_lose_no_record(db_sessionmaker) -> None:
    # Records priced before the admin API capped prices (1e12 per million tokens) cost the
    # column's most each: two in one hour, written in separate batches (the rollup's
    # upsert adds to a stored sum), and a third later that day. Summed, they pass 2^63.
    most = 2**63 - 1
    prices = TokenPrices(1e12, 1e12)

    def dear(i: int, at: datetime) -> UsageRecord:
        return UsageRecord(
            f"req_{i}", "ten_a", "batch", "m", 10_000, 1, 1.0, 9.0, 19.0, "ok", at, prices=prices
        )

    cheap = UsageRecord("req_9", "ten_a", "batch", "m", 1, 1, 1.0, 9.0, 19.0, "ok", START)
    await _write(db_sessionmaker, [dear(1, START), cheap], max_batch=10)
    await _write(db_sessionmaker, [dear(2, START + timedelta(minutes=5))], max_batch=10)
    await _write(db_sessionmaker, [dear(3, START + timedelta(hours=3))], max_batch=10)
    async with db_sessionmaker() as session:
        hourly = (await session.execute(select(UsageHourly.requests, UsageHourly.cost_nanos))).all()
    assert sorted(hourly) == [(1, most), (3, most)]
    day = UsageQuery(START, START + timedelta(days=1), group_by="day")
    whole_and_edges = UsageQuery(
        START - timedelta(minutes=30), START + timedelta(hours=3, minutes=30)
    )
    for query in (day, whole_and_edges):
        lines = await usage_report(db_sessionmaker, query)
        assert lines == await usage_report_from_records(db_sessionmaker, query)
        assert sum(line.requests for line in lines) == 4
        assert {line.cost for line in lines} == {most / 1e9}
    # Summed again from the records, the hours come out the same, with a record written
    # before costs were (migration 0008) priced now at a price from before the cap.
    async with db_sessionmaker() as session, session.begin():
        await session.execute(
            update(UsageRow).where(UsageRow.request_id == "req_3").values(cost_nanos=None)
        )
        await session.execute(
            update(Tier).where(Tier.name == "batch").values(price_input_per_mtok=1e12)
        )
        await rebuild_usage_rollup(session, day.start, day.end)
    async with db_sessionmaker() as session:
        again = (await session.execute(select(UsageHourly.requests, UsageHourly.cost_nanos))).all()
    assert sorted(again) == sorted(hourly)


def test_prices_of_up_to_three_decimals_are_exact_per_token() -> None:
    assert TokenPrices(0.075, 0.6).cost_nanos(3, 7) == 3 * 75 + 7 * 600
    # Finer prices round half away from zero, as SQL's round() in the migration does.
    assert TokenPrices(0.0005, 0.0).cost_nanos(1, 0) == 1
    assert TokenPrices(0.0005, 0.0).cost_nanos(3, 0) == 2


# Migration 0005 on data written before it.

_USAGE_AT_0004 = sa.table(
    "usage_records",
    *(
        sa.column(name)
        for name in (
            "request_id",
            "tenant_id",
            "tier",
            "model",
            "prompt_tokens",
            "completion_tokens",
            "queue_wait_ms",
            "ttft_ms",
            "e2e_ms",
            "outcome",
        )
    ),
    sa.column("created_at", UTCDateTime),
)


async def test_migration_0005_backfills_the_rollup(database_url: str) -> None:
    await asyncio.to_thread(upgrade_to_head, database_url)
    await asyncio.to_thread(downgrade_to, database_url, "0004")
    rng = random.Random(5)
    before, after = random_records(rng, 800, choices=(1,)), random_records(rng, 200)
    engine = create_db_engine(database_url)
    sessionmaker = create_sessionmaker(engine)
    try:
        await _set_tier_terms(sessionmaker)
        async with engine.begin() as connection:
            await connection.execute(sa.insert(_USAGE_AT_0004), [_at_0004(rec) for rec in before])
        await engine.dispose()  # let the migration have the SQLite file

        await asyncio.to_thread(upgrade_to_head, database_url)
        async with sessionmaker() as session:
            stored = dict(
                (await session.execute(select(UsageRow.request_id, UsageRow.slo_met))).all()
            )
        assert stored == {rec.request_id: is_met(rec) for rec in before}
        # New records land in the hours the backfill created (same keys, not duplicates).
        await _write(sessionmaker, [_renamed(rec) for rec in after], max_batch=50)
        records = before + [_renamed(rec) for rec in after]
        async with sessionmaker() as session:
            hours = await session.scalar(select(func.count(func.distinct(UsageHourly.hour))))
        assert hours == len({_hour(rec) for rec in records})
        await _assert_reports_agree(sessionmaker, records, random_queries(rng, 15))
        await engine.dispose()

        await asyncio.to_thread(downgrade_to, database_url, "0004")
        assert await asyncio.to_thread(current_revision, database_url) == "0004"
        async with engine.connect() as connection:
            columns = await connection.run_sync(
                lambda c: {col["name"] for col in sa.inspect(c).get_columns("usage_records")}
            )
            tables = await connection.run_sync(lambda c: sa.inspect(c).get_table_names())
            num_rows = await connection.scalar(select(func.count()).select_from(_USAGE_AT_0004))
        assert "slo_met" not in columns
        assert "usage_hourly" not in tables
        assert num_rows == len(records)  # the downgrade keeps every record
    finally:
        await engine.dispose()


def _at_0004(rec: UsageRecord) -> dict:
    """A record as a row of revision 0004, before the choices (older gateways: n = 1)."""
    assert rec.num_choices == 1
    return {
        k: v for k, v in rec.__dict__.items() if k not in ("num_choices", "longest_choice_tokens")
    }


def _hour(rec: UsageRecord) -> datetime:
    return rec.created_at.replace(minute=0, second=0, microsecond=0)


def _renamed(rec: UsageRecord) -> UsageRecord:
    return UsageRecord(**{**rec.__dict__, "request_id": f"late_{rec.request_id}"})


async def test_rebuild_repairs_hours_written_by_an_older_gateway(db_sessionmaker) -> None:
    # During a rolling upgrade a gateway on the previous release inserts plain rows: no
    # slo_met, no rollup. The report misses them until the hours are rebuilt.
    rng = random.Random(7)
    await _set_tier_terms(db_sessionmaker)
    new, old = random_records(rng, 300), random_records(rng, 300, choices=(1,))
    old = [_renamed(rec) for rec in old]
    await _write(db_sessionmaker, new, max_batch=64)
    async with db_sessionmaker() as session, session.begin():
        await session.execute(sa.insert(_USAGE_AT_0004), [_at_0004(rec) for rec in old])
    records = new + old
    whole = UsageQuery(START, START + SPAN, "day")
    assert await usage_report(db_sessionmaker, whole) != await usage_report_from_records(
        db_sessionmaker, whole
    )

    for _ in range(2):  # a second rebuild changes nothing
        async with db_sessionmaker() as session, session.begin():
            num_rows = await rebuild_usage_rollup(
                session, START + timedelta(minutes=30), START + SPAN - timedelta(minutes=1)
            )
        assert num_rows == len({(_hour(rec), rec.tenant_id, rec.tier) for rec in records})
        async with db_sessionmaker() as session:
            stored = dict(
                (await session.execute(select(UsageRow.request_id, UsageRow.slo_met))).all()
            )
        assert stored == {rec.request_id: is_met(rec) for rec in records}
        await _assert_reports_agree(db_sessionmaker, records, random_queries(rng, 10))


async def test_the_sql_slo_rule_is_the_python_rule(db_sessionmaker) -> None:
    # The rule the rebuild applies in SQL to rows written without slo_met, on rows of
    # every shape the Python rule sees (num_choices included), not only older gateways'.
    rng = random.Random(11)
    await _set_tier_terms(db_sessionmaker)
    records = random_records(rng, 600)
    async with db_sessionmaker() as session, session.begin():
        rows = [{**rec.__dict__, "slo_met": None} for rec in records]
        await session.execute(sa.insert(UsageRow.__table__), rows)
    async with db_sessionmaker() as session, session.begin():
        await rebuild_usage_rollup(session, START, START + SPAN)
    async with db_sessionmaker() as session:
        stored = dict((await session.execute(select(UsageRow.request_id, UsageRow.slo_met))).all())
    assert stored == {rec.request_id: is_met(rec) for rec in records}


async def test_migration_0007_takes_unserved_prompts_out_of_the_bill(database_url: str) -> None:
    """Hours summed before 0007 billed the prompts of requests that never left the queue;
    the upgrade takes them out, the downgrade puts them back."""

    async def billed_input() -> int:
        engine = create_db_engine(database_url)
        try:
            async with engine.connect() as connection:
                total = await connection.scalar(
                    sa.text("SELECT SUM(input_tokens) FROM usage_hourly")
                )
        finally:
            await engine.dispose()
        return int(total)

    rng = random.Random(9)
    records = random_records(rng, 400, choices=(1,))
    unserved = sum(
        rec.prompt_tokens
        for rec in records
        if rec.queue_wait_ms is None and not rec.outcome.startswith("rejected:")
    )
    assert unserved > 0
    served = sum(
        rec.prompt_tokens
        for rec in records
        if rec.queue_wait_ms is not None and not rec.outcome.startswith("rejected:")
    )
    await asyncio.to_thread(upgrade_to_head, database_url)
    await asyncio.to_thread(downgrade_to, database_url, "0004")
    engine = create_db_engine(database_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(sa.insert(_USAGE_AT_0004), [_at_0004(rec) for rec in records])
    finally:
        await engine.dispose()
    await asyncio.to_thread(migrate_to, database_url, "0006")  # 0005 bills every prompt
    assert await billed_input() == served + unserved
    await asyncio.to_thread(upgrade_to_head, database_url)
    assert await billed_input() == served
    await asyncio.to_thread(migrate_to, database_url, "0006")
    assert await billed_input() == served + unserved


async def test_migration_0008_prices_history_at_the_prices_it_was_reported_at(
    database_url: str,
) -> None:
    """Rows written before 0008 are priced at the tiers' prices of the upgrade (what the
    report showed), each hour to the unit of its records; from then on a price change
    re-prices nothing, and the downgrade drops the columns."""
    rng = random.Random(13)
    records = random_records(rng, 500, choices=(1,))
    await asyncio.to_thread(upgrade_to_head, database_url)
    await asyncio.to_thread(downgrade_to, database_url, "0004")
    engine = create_db_engine(database_url)
    sessionmaker = create_sessionmaker(engine)
    try:
        await _set_tier_terms(sessionmaker)
        async with engine.begin() as connection:
            await connection.execute(sa.insert(_USAGE_AT_0004), [_at_0004(rec) for rec in records])
        await engine.dispose()
        await asyncio.to_thread(migrate_to, database_url, "0007")
        await asyncio.to_thread(upgrade_to_head, database_url)
        whole = UsageQuery(START - timedelta(hours=1), START + SPAN + timedelta(hours=1), "day")
        await _assert_reports_agree(sessionmaker, records, [whole, *random_queries(rng, 10)])
        reported = await usage_report(sessionmaker, whole)
        async with sessionmaker() as session, session.begin():
            await session.execute(update(Tier).values(price_input_per_mtok=99.0))
        assert await usage_report(sessionmaker, whole) == reported
        await engine.dispose()

        await asyncio.to_thread(migrate_to, database_url, "0007")
        async with engine.connect() as connection:
            columns = await connection.run_sync(
                lambda c: {
                    table: {col["name"] for col in sa.inspect(c).get_columns(table)}
                    for table in ("usage_records", "usage_hourly")
                }
            )
        assert "cost_nanos" not in columns["usage_records"] | columns["usage_hourly"]
    finally:
        await engine.dispose()
