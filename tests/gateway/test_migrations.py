"""Migrations: one head; upgrade -> downgrade -> upgrade on SQLite and PostgreSQL; the
migrated schema equals the models; seeded tiers."""

from __future__ import annotations

import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from gateway.db.models import Base
from gateway.db.session import create_db_engine
from gateway.migrate import current_revision, downgrade_to, head_revisions, upgrade_to_head

TABLES = {"tiers", "tenants", "api_keys", "usage_records"}


def _run(coro_fn):
    return asyncio.run(coro_fn())


async def _tables(url: str) -> set[str]:
    engine = create_db_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def _scalar_rows(url: str, sql: str, **params) -> list:
    engine = create_db_engine(url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text(sql), params)).all())
    finally:
        await engine.dispose()


def test_exactly_one_head() -> None:
    assert len(head_revisions()) == 1


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    assert current_revision(database_url) is None
    upgrade_to_head(database_url)
    head = head_revisions()[0]
    assert current_revision(database_url) == head
    assert _run(lambda: _tables(database_url)) >= TABLES

    downgrade_to(database_url, "base")
    assert current_revision(database_url) is None
    assert not TABLES & _run(lambda: _tables(database_url))

    upgrade_to_head(database_url)
    assert current_revision(database_url) == head
    rows = _run(lambda: _scalar_rows(database_url, "SELECT name, rank FROM tiers ORDER BY rank"))
    assert [tuple(r) for r in rows] == [("priority", 0), ("interactive", 1), ("batch", 2)]


def test_each_step_down_and_up(database_url: str) -> None:
    # Every revision's downgrade is real: step down one at a time, then back up.
    upgrade_to_head(database_url)
    downgrade_to(database_url, "0001")
    assert _run(lambda: _scalar_rows(database_url, "SELECT name FROM tiers")) == []
    downgrade_to(database_url, "base")
    upgrade_to_head(database_url)
    assert len(_run(lambda: _scalar_rows(database_url, "SELECT name FROM tiers"))) == 3


def test_migrated_schema_matches_models(migrated_database_url: str) -> None:
    async def diff() -> list:
        engine = create_db_engine(migrated_database_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda c: compare_metadata(
                        MigrationContext.configure(c, opts={"compare_type": True}),
                        Base.metadata,
                    )
                )
        finally:
            await engine.dispose()

    assert _run(diff) == []


def test_seeded_tiers(migrated_database_url: str) -> None:
    rows = _run(
        lambda: _scalar_rows(
            migrated_database_url,
            "SELECT name, ttft_slo_ms, tpot_slo_ms, max_queue_ms, completion_window_s, "
            "min_share, preemptible, price_output_per_mtok FROM tiers ORDER BY rank",
        )
    )
    by_name = {r[0]: r for r in rows}
    assert by_name["priority"][1:4] == (500.0, 50.0, 2000.0)
    assert by_name["interactive"][1:4] == (2000.0, 100.0, 10000.0)
    assert by_name["interactive"][5] > 0
    batch = by_name["batch"]
    assert batch[1:4] == (None, None, None)
    assert batch[4] == 86_400
    assert batch[5] > 0
    assert bool(batch[6]) is True
    assert batch[7] < by_name["interactive"][7] < by_name["priority"][7]


def test_seed_downgrade_refuses_while_tenants_use_tiers(migrated_database_url: str) -> None:
    # Foreign keys hold on SQLite too (the engine switches them on).
    async def add_tenant() -> None:
        engine = create_db_engine(migrated_database_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "INSERT INTO tenants (id, name, tier, weight, status) "
                        "VALUES ('ten_x', 'x', 'batch', 1, 'active')"
                    )
                )
        finally:
            await engine.dispose()

    _run(add_tenant)
    with pytest.raises(IntegrityError):
        downgrade_to(migrated_database_url, "0001")
    assert current_revision(migrated_database_url) == head_revisions()[0]
