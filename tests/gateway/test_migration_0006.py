"""Migration 0006 (tiers.max_queued_jobs) on SQLite and PostgreSQL: the seeded batch cap,
admin-made tiers left uncapped, and a downgrade that works while tenants use the tiers."""

from __future__ import annotations

import asyncio

from sqlalchemy import inspect, text

from gateway.db.session import create_db_engine
from gateway.migrate import current_revision, downgrade_to, upgrade_to_head


async def _execute(url: str, *statements: str) -> list[list[tuple]]:
    engine = create_db_engine(url)
    try:
        async with engine.begin() as conn:
            results = [await conn.execute(text(s)) for s in statements]
            return [
                [tuple(r) for r in result.all()] if result.returns_rows else []
                for result in results
            ]
    finally:
        await engine.dispose()


async def _tier_columns(url: str) -> set[str]:
    engine = create_db_engine(url)
    try:
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: inspect(c).get_columns("tiers"))
            return {c["name"] for c in columns}
    finally:
        await engine.dispose()


def test_queue_cap_column_up_and_down_with_tenants(database_url: str) -> None:
    upgrade_to_head(database_url)
    downgrade_to(database_url, "0005")
    assert "max_queued_jobs" not in asyncio.run(_tier_columns(database_url))
    # An admin-made tier and a tenant on the batch tier exist before the upgrade.
    asyncio.run(
        _execute(
            database_url,
            "INSERT INTO tiers (name, rank, min_share, preemptible, price_input_per_mtok, "
            "price_output_per_mtok) VALUES ('gold', 0, 0, false, 0, 0)",
            "INSERT INTO tenants (id, name, tier, weight, status) "
            "VALUES ('ten_x', 'x', 'batch', 1, 'active')",
        )
    )
    upgrade_to_head(database_url)
    [caps] = asyncio.run(
        _execute(database_url, "SELECT name, max_queued_jobs FROM tiers ORDER BY rank, name")
    )
    assert dict(caps) == {"gold": None, "priority": None, "interactive": None, "batch": 10_000}

    # The tenants' foreign key to tiers does not stand in the way of the downgrade.
    downgrade_to(database_url, "0005")
    assert current_revision(database_url) == "0005"
    assert "max_queued_jobs" not in asyncio.run(_tier_columns(database_url))
    [tenants] = asyncio.run(_execute(database_url, "SELECT id, tier FROM tenants"))
    assert tenants == [("ten_x", "batch")]
    upgrade_to_head(database_url)
    assert "max_queued_jobs" in asyncio.run(_tier_columns(database_url))
