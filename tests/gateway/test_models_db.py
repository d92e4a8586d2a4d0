"""The models on both databases: time zones, keys and cascades, the tier catalog, demo
tenants."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.exc import IntegrityError, StatementError

from gateway.db import repo
from gateway.db.models import ApiKey, Tenant, Tier
from gateway.demo import ensure_demo_tenants
from gateway.errors import NotFoundError
from gateway.tiers import TierCatalog


async def _tenant(sessionmaker, name: str = "acme", tier: str = "batch") -> Tenant:
    async with sessionmaker() as session:
        tenant = Tenant(name=name, tier=tier)
        session.add(tenant)
        await session.commit()
    return tenant


async def test_defaults_and_ids(db_sessionmaker) -> None:
    tenant = await _tenant(db_sessionmaker)
    async with db_sessionmaker() as session:
        row = await session.get(Tenant, tenant.id)
    assert row is not None
    assert row.id.startswith("ten_")
    assert len(row.id) == 28
    assert (row.weight, row.status, row.rpm) == (1.0, "active", None)
    assert row.created_at.tzinfo is not None
    assert abs(row.created_at - datetime.now(UTC)) < timedelta(minutes=1)


async def test_timestamps_round_trip_as_aware_utc(db_sessionmaker) -> None:
    tenant = await _tenant(db_sessionmaker)
    plus_two = timezone(timedelta(hours=2))
    expires = datetime(2031, 2, 3, 14, 5, 6, 789, tzinfo=plus_two)
    async with db_sessionmaker() as session:
        key = await repo.add_api_key(
            session, tenant_id=tenant.id, digest="d" * 64, prefix="tg-abcdef", expires_at=expires
        )
        await session.commit()
    async with db_sessionmaker() as session:
        stored = await session.get(ApiKey, key.id)
    assert stored is not None
    assert stored.expires_at == expires
    assert stored.expires_at.utcoffset() == timedelta(0)
    # Seeded rows get their timestamps from the database's clock.
    async with db_sessionmaker() as session:
        seeded = await session.get(Tier, "batch")
    assert seeded is not None
    assert seeded.created_at.tzinfo is not None


async def test_naive_timestamps_are_refused(db_sessionmaker) -> None:
    tenant = await _tenant(db_sessionmaker)
    async with db_sessionmaker() as session:
        session.add(
            ApiKey(
                tenant_id=tenant.id, digest="e" * 64, prefix="p", expires_at=datetime(2030, 1, 1)
            )
        )
        with pytest.raises(StatementError, match="naive"):
            await session.commit()


async def test_digest_is_unique(db_sessionmaker) -> None:
    tenant = await _tenant(db_sessionmaker)
    async with db_sessionmaker() as session:
        await repo.add_api_key(session, tenant_id=tenant.id, digest="f" * 64, prefix="p")
        await session.commit()
    async with db_sessionmaker() as session:
        with pytest.raises(IntegrityError):
            await repo.add_api_key(session, tenant_id=tenant.id, digest="f" * 64, prefix="p")


async def test_tier_in_use_cannot_be_deleted_and_keys_follow_their_tenant(
    db_sessionmaker,
) -> None:
    tenant = await _tenant(db_sessionmaker)
    async with db_sessionmaker() as session:
        await repo.add_api_key(session, tenant_id=tenant.id, digest="a" * 64, prefix="p")
        await session.commit()
    async with db_sessionmaker() as session:
        await session.delete(await session.get(Tier, "batch"))
        with pytest.raises(IntegrityError):
            await session.commit()
    async with db_sessionmaker() as session:
        assert await repo.count_tenants_on_tier(session, "batch") == 1
        assert await repo.delete_tenant(session, tenant.id) is True
        await session.commit()
        assert await repo.delete_tenant(session, tenant.id) is False
        assert await session.scalar(select(func.count()).select_from(ApiKey)) == 0


async def test_tier_catalog(db_sessionmaker) -> None:
    catalog = TierCatalog(db_sessionmaker, ttl_s=0.2)
    assert [t.name for t in await catalog.all()] == ["priority", "interactive", "batch"]
    batch = await catalog.get("batch")
    assert (batch.rank, batch.preemptible, batch.completion_window_s) == (2, True, 86_400)
    assert batch.prices.cost(1_000_000, 2_000_000) == pytest.approx(0.25 + 2 * 0.75)
    with pytest.raises(NotFoundError):
        await catalog.get("platinum")

    async with db_sessionmaker() as session:
        await session.execute(update(Tier).where(Tier.name == "batch").values(rank=9))
        await session.commit()
    assert (await catalog.get("batch")).rank == 2  # cached
    await asyncio.sleep(0.25)
    assert (await catalog.get("batch")).rank == 9  # refreshed after the TTL

    async with db_sessionmaker() as session:
        await session.execute(update(Tier).where(Tier.name == "batch").values(rank=4))
        await session.commit()
    catalog.invalidate()
    assert (await catalog.get("batch")).rank == 4  # at once after invalidate()
    assert [t.name for t in await catalog.all()] == ["priority", "interactive", "batch"]


async def test_tier_catalog_concurrent_readers_share_one_load(db_sessionmaker) -> None:
    catalog = TierCatalog(db_sessionmaker, ttl_s=60)
    statements: list[str] = []
    engine = db_sessionmaker.kw["bind"].sync_engine
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    tiers = await asyncio.gather(*(catalog.get("priority") for _ in range(20)))
    assert {t.rank for t in tiers} == {0}
    assert len(statements) == 1


async def test_demo_tenants_are_idempotent(db_sessionmaker) -> None:
    first = await ensure_demo_tenants(db_sessionmaker)
    second = await ensure_demo_tenants(db_sessionmaker)
    assert [(d.name, d.tier) for d in first] == [
        ("demo-priority", "priority"),
        ("demo-interactive", "interactive"),
        ("demo-batch", "batch"),
    ]
    assert [(d.name, d.tier) for d in second] == [(d.name, d.tier) for d in first]
    assert {d.api_key for d in first}.isdisjoint(d.api_key for d in second)
    async with db_sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Tenant)) == 3
        assert await session.scalar(select(func.count()).select_from(ApiKey)) == 6
