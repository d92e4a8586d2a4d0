"""How long /admin/v1/usage's aggregation takes over millions of usage rows (PostgreSQL).

Creates a scratch database, migrates it, fills usage_records with `--rows` rows spread
over `--days` days across `--tenants` tenants and the three seeded tiers (one INSERT ...
SELECT FROM generate_series, server side), VACUUM ANALYZEs it, then times the report a
dashboard or billing export asks for: one day by hour, the whole range by day, and one
tenant over the whole range. Drops the database at the end.

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

    from gateway.admin.usage_report import UsageQuery, usage_report
    from gateway.db.session import create_db_engine, create_sessionmaker
    from gateway.migrate import upgrade_to_head

    name = f"tg_bench_usage_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    base = args.admin_url.rsplit("/", 1)[0]
    try:
        url = f"{base.replace('postgresql://', 'postgresql+asyncpg://')}/{name}"
        await asyncio.to_thread(upgrade_to_head, url)
        end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        conn = await asyncpg.connect(f"{base}/{name}")
        started = time.perf_counter()
        await conn.execute(FILL, args.rows, args.tenants, end, args.days)
        await conn.execute("VACUUM ANALYZE usage_records")
        print(f"filled {args.rows:,} rows in {time.perf_counter() - started:.1f} s")
        await conn.close()

        engine = create_db_engine(url)
        sessionmaker = create_sessionmaker(engine)
        queries = {
            "last day, by hour": UsageQuery(end - timedelta(days=1), end, "hour"),
            f"all {args.days} days, by day": UsageQuery(
                end - timedelta(days=args.days), end, "day"
            ),
            "one tenant, all days, by hour": UsageQuery(
                end - timedelta(days=args.days), end, "hour", tenant_id="ten_7"
            ),
        }
        for label, query in queries.items():
            samples, lines = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                lines = await usage_report(sessionmaker, query)
                samples.append((time.perf_counter() - t0) * 1000)
            print(
                f"{label:32} {len(lines):7,} lines  median {statistics.median(samples):8.1f} ms"
                f"  min {min(samples):8.1f} ms"
            )
        await engine.dispose()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/test")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
