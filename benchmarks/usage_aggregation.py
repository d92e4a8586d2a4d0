"""How long /admin/v1/usage's aggregation takes over millions of usage rows (PostgreSQL).

Creates a scratch database at migration 0004, fills usage_records with `--rows` rows
spread over `--days` days across `--tenants` tenants and the three seeded tiers (one
INSERT ... SELECT FROM generate_series, server side), then upgrades to the head, timing
migration 0005's backfill of slo_met and the hourly rollup. Then it times the reports a
dashboard or billing export asks for (one day by hour, the whole range by day, one tenant
over the whole range; each with ranges off the hour too, so the edges come from the raw
rows) twice: summed from usage_records alone (what the report did before the rollup) and
as /admin/v1/usage does it now, checking the two give the same lines. Last, what the
rollup costs the UsageWriter: batches of `--batch` records inserted alone vs inserted
with their rollup upsert. Drops the database at the end.

    python benchmarks/usage_aggregation.py [--rows 1000000] [--days 30] [--tenants 200]
        [--admin-url postgresql://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

FILL = """
INSERT INTO usage_records (request_id, tenant_id, tier, model, prompt_tokens,
    completion_tokens, queue_wait_ms, ttft_ms, e2e_ms, outcome, created_at)
SELECT 'req_' || g, 'ten_' || (g % $2), (ARRAY['priority','interactive','batch'])[1 + g % 3],
    'tiny-random', 50 + g % 500, 1 + g % 300, (g % 97)::float, 20 + (g % 900)::float,
    400 + (g % 9000)::float,
    CASE WHEN g % 50 = 0 THEN 'rejected:rate_limit_exceeded'
         WHEN g % 97 = 0 THEN 'aborted' ELSE 'ok' END,
    $3::timestamptz - (g % ($4 * 86400)) * interval '1 second'
FROM generate_series(1, $1) AS g
"""


async def run(args: argparse.Namespace) -> None:
    import asyncpg

    from gateway.admin.usage_report import UsageQuery, usage_report, usage_report_from_records
    from gateway.db.session import create_db_engine, create_sessionmaker
    from gateway.migrate import downgrade_to, upgrade_to_head

    name = f"tg_bench_usage_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    base = args.admin_url.rsplit("/", 1)[0]
    try:
        url = f"{base.replace('postgresql://', 'postgresql+asyncpg://')}/{name}"
        await asyncio.to_thread(upgrade_to_head, url)
        await asyncio.to_thread(downgrade_to, url, "0004")  # before the rollup
        end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        conn = await asyncpg.connect(f"{base}/{name}")
        started = time.perf_counter()
        await conn.execute(FILL, args.rows, args.tenants, end, args.days)
        await conn.execute("VACUUM ANALYZE usage_records")
        print(f"filled {args.rows:,} rows in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        await asyncio.to_thread(upgrade_to_head, url)
        print(f"migration 0005 (slo_met + rollup backfill) {time.perf_counter() - started:.1f} s")
        await conn.execute("VACUUM ANALYZE usage_records")
        await conn.execute("VACUUM ANALYZE usage_hourly")
        num_buckets = await conn.fetchval("SELECT count(*) FROM usage_hourly")
        print(f"usage_hourly: {num_buckets:,} rows")
        await conn.close()

        engine = create_db_engine(url)
        sessionmaker = create_sessionmaker(engine)
        off = timedelta(minutes=17, seconds=3)  # edges inside an hour
        whole = end - timedelta(days=args.days)
        queries = {
            "last day, by hour": UsageQuery(end - timedelta(days=1), end, "hour"),
            "last day +-17 min, by hour": UsageQuery(
                end - timedelta(days=1) - off, end - off, "hour"
            ),
            f"all {args.days} days, by day": UsageQuery(whole, end, "day"),
            f"all {args.days} days +-17 min, by day": UsageQuery(whole + off, end - off, "day"),
            "one tenant, all days, by hour": UsageQuery(whole, end, "hour", tenant_id="ten_7"),
        }
        print(f"{'query':34} {'lines':>7}  {'records only':>14}  {'rollup':>10}  speed-up")
        for label, query in queries.items():
            medians, outputs = [], []
            for report in (usage_report_from_records, usage_report):
                samples: list[float] = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    lines = await report(sessionmaker, query)
                    samples.append((time.perf_counter() - t0) * 1000)
                medians.append(statistics.median(samples))
                outputs.append(lines)
            if outputs[0] != outputs[1]:
                raise SystemExit(f"{label}: the rollup report differs from the records")
            print(
                f"{label:34} {len(outputs[1]):7,}  {medians[0]:11.1f} ms  {medians[1]:7.1f} ms"
                f"  {medians[0] / medians[1]:6.1f}x"
            )
        await _time_writes(sessionmaker, args, end)
        await engine.dispose()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _time_writes(sessionmaker, args: argparse.Namespace, end: datetime) -> None:
    """Per-batch write time: records alone (before) vs records + rollup upsert (now)."""
    from sqlalchemy import insert

    from gateway.db.models import UsageRow
    from gateway.usage import UsageRecord, write_usage

    def batch(tag: str, number: int) -> list[UsageRecord]:
        return [
            UsageRecord(
                f"bench_{tag}_{number}_{i}",
                f"ten_{i % args.tenants}",
                "interactive",
                "tiny-random",
                100,
                50,
                1.0,
                80.0,
                900.0,
                "ok",
                end - timedelta(seconds=i % 7200),
            )
            for i in range(args.batch)
        ]

    async def records_only(records: list[UsageRecord]) -> None:
        async with sessionmaker() as session, session.begin():
            await session.execute(insert(UsageRow), [vars(rec) for rec in records])

    async def with_rollup(records: list[UsageRecord]) -> None:
        async with sessionmaker() as session, session.begin():
            await write_usage(session, records)

    medians = []
    for tag, write in (("raw", records_only), ("rollup", with_rollup)):
        samples = []
        for number in range(args.repeat * 4):
            records = batch(tag, number)
            t0 = time.perf_counter()
            await write(records)
            samples.append((time.perf_counter() - t0) * 1000)
        medians.append(statistics.median(samples))
    print(
        f"writer, {args.batch} records per batch: records only {medians[0]:.1f} ms, "
        f"records + rollup {medians[1]:.1f} ms ({args.batch / medians[1] * 1000:,.0f} records/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=500, help="records per writer batch")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/test")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
