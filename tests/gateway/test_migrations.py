"""Migrations: one head; upgrade -> downgrade -> upgrade on SQLite and PostgreSQL; the
migrated schema equals the models; seeded tiers."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from gateway.db.models import Base
from gateway.db.session import create_db_engine
from gateway.migrate import current_revision, downgrade_to, head_revisions, upgrade_to_head
from tests.gateway.conftest import execute_sql

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


def test_seed_downgrade_keeps_the_tiers_tenants_are_on(migrated_database_url: str) -> None:
    # Foreign keys hold on SQLite too (the engine switches them on): deleting the batch
    # tier under its tenant would fail, as it did on every --demo database.
    url = migrated_database_url
    _run(
        lambda: execute_sql(
            url,
            "INSERT INTO tenants (id, name, tier, weight, status) "
            "VALUES ('ten_x', 'x', 'batch', 1, 'active')",
            "UPDATE tiers SET rpm = 7 WHERE name = 'batch'",
            "INSERT INTO api_keys (id, tenant_id, digest, prefix, name) "
            "VALUES ('key_x', 'ten_x', 'd', 'tg-x', 'k')",
            "INSERT INTO usage_records (request_id, tenant_id, tier, model, prompt_tokens, "
            "completion_tokens, e2e_ms, outcome, created_at) "
            "VALUES ('req_x', 'ten_x', 'batch', 'tiny-random', 1, 1, 1, 'ok', "
            "'2025-06-01 10:00:00')",
        )
    )
    downgrade_to(url, "0001")
    assert current_revision(url) == "0001"
    assert _run(lambda: _scalar_rows(url, "SELECT name, rpm FROM tiers")) == [("batch", 7)]

    # Back up: the kept tier stays as the admin left it, the others are seeded again.
    upgrade_to_head(url)
    rows = _run(lambda: _scalar_rows(url, "SELECT name, rpm, max_queued_jobs FROM tiers"))
    assert {r[0]: tuple(r[1:]) for r in rows} == {
        "priority": (600, None),
        "interactive": (300, None),
        "batch": (7, 10_000),
    }
    assert _run(lambda: _scalar_rows(url, "SELECT id, tier FROM tenants")) == [("ten_x", "batch")]

    # All the way down and up again with the data in place.
    downgrade_to(url, "base")
    assert not TABLES & _run(lambda: _tables(url))
    upgrade_to_head(url)
    assert len(_run(lambda: _scalar_rows(url, "SELECT name FROM tiers"))) == 3


def test_two_migrations_at_once_both_succeed(database_url: str) -> None:
    # A retried migration Job while its first pod still runs, or two `serve` started on
    # one fresh data dir: the second waits for the first's lock (PostgreSQL's advisory
    # lock, SQLite's write lock taken before the revision is read), then has nothing to
    # do. On SQLite both used to read "no schema" and one failed on "table exists".
    command = [sys.executable, "-m", "gateway.cli", "migrate", "--database-url", database_url]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=180)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert current_revision(database_url) in head_revisions()
