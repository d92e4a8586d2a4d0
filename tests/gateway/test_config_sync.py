"""Admin changes reach every process: two gateways' caches and pushes, on real Redis and
SQL, in one event loop (each "process" has its own catalog, key cache and sync)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from sqlalchemy import update

from gateway.auth import generate_api_key
from gateway.config_sync import ConfigSync, SyncedKeyAuthenticator, SyncedTierCatalog
from gateway.db import repo
from gateway.db.models import Tenant, Tier
from gateway.errors import AuthenticationError
from scheduler.memory_backend import MemoryBackend

POLL_MS = 50
LONG_TTL_S = 60.0  # caches that would outlive any test: only the sync can refresh them


@dataclass
class Process:
    tiers: SyncedTierCatalog
    auth: SyncedKeyAuthenticator
    sync: ConfigSync


@pytest.fixture
async def processes(db_sessionmaker, redis_url, redis_prefix) -> AsyncIterator[list[Process]]:
    queue = MemoryBackend()  # the queue both push their tier table to
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    made = []
    for _ in range(2):
        sync = ConfigSync(
            queue, redis_client=client, version_key=f"{redis_prefix}version", poll_ms=POLL_MS
        )
        tiers = SyncedTierCatalog(db_sessionmaker, ttl_s=LONG_TTL_S, on_change=sync.changed)
        auth = SyncedKeyAuthenticator(
            db_sessionmaker, tiers, cache_ttl_s=LONG_TTL_S, on_change=sync.changed
        )
        sync.bind(tiers, auth)
        await sync.start()
        made.append(Process(tiers, auth, sync))
    try:
        yield made
    finally:
        for process in made:
            await process.sync.aclose()
        await client.aclose()


async def _tenant_with_key(sessionmaker, name: str) -> tuple[Tenant, str, str]:
    secret, digest, prefix = generate_api_key()
    async with sessionmaker() as session:
        tenant = Tenant(name=name, tier="interactive")
        session.add(tenant)
        await session.flush()
        key = await repo.add_api_key(session, tenant_id=tenant.id, digest=digest, prefix=prefix)
        await session.commit()
    return tenant, key.id, secret


async def test_a_write_here_does_not_hide_one_made_elsewhere(db_sessionmaker, processes) -> None:
    a, b = processes
    _, key_id, secret = await _tenant_with_key(db_sessionmaker, "revoked-on-a")
    other, _, _ = await _tenant_with_key(db_sessionmaker, "changed-on-b")
    await b.auth.authenticate(f"Bearer {secret}")  # cached on B
    async with db_sessionmaker() as session:
        await repo.revoke_api_key(session, key_id)
        await session.commit()
    a.auth.invalidate_key(key_id)  # revoked through A...
    await asyncio.sleep(0.005)
    b.auth.invalidate_tenant(other.id)  # ...and an unrelated write on B right after
    await asyncio.sleep(4 * POLL_MS / 1000)
    # Before, B took the version its own write produced as seen, and kept the key.
    with pytest.raises(AuthenticationError, match="revoked"):
        await b.auth.authenticate(f"Bearer {secret}")


async def test_the_queue_ends_with_the_tiers_sql_holds(db_sessionmaker, processes) -> None:
    a, b = processes
    await a.tiers.all()  # A's cache holds the old rank
    async with db_sessionmaker() as session:
        await session.execute(update(Tier).where(Tier.name == "batch").values(rank=7))
        await session.commit()
    b.tiers.invalidate()  # the write is B's: B pushes the new table
    tenant, _, _ = await _tenant_with_key(db_sessionmaker, "changed-on-a")
    a.auth.invalidate_tenant(tenant.id)  # an unrelated write on A, whose tiers are stale
    await asyncio.sleep(4 * POLL_MS / 1000)
    queued = {t.name: t.rank for t in await a.sync._backend.get_tiers()}
    # Before, A pushed its cached table last and the queue kept rank 2 until the next write.
    assert queued["batch"] == 7


async def test_a_tier_made_elsewhere_is_found_at_once(db_sessionmaker, processes) -> None:
    _, b = processes
    await b.tiers.all()
    async with db_sessionmaker() as session:
        session.add(Tier(name="fresh", rank=5))
        await session.commit()
    # Not announced (as if the poll had not come round yet): only the miss reloads.
    await asyncio.sleep(0.15)  # longer than the catalog's least time between reloads
    # Before, B answered 404 until its poll or TTL; a key on the new tier is valid now.
    assert (await b.tiers.get("fresh")).rank == 5
