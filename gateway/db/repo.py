"""Small repository functions over the gateway's tables, one session per call site.

They neither commit nor validate: callers (the admin API, demo setup) own the
transaction and check input at the edge.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.batch_models import ACTIVE_STATUSES, BatchRow
from gateway.db.models import ApiKey, Tenant, Tier, utcnow


async def list_tiers(session: AsyncSession) -> list[Tier]:
    return list((await session.scalars(select(Tier).order_by(Tier.rank, Tier.name))).all())


async def get_tier(session: AsyncSession, name: str) -> Tier | None:
    return await session.get(Tier, name)


async def count_tenants_on_tier(session: AsyncSession, name: str) -> int:
    return await session.scalar(select(func.count()).where(Tenant.tier == name)) or 0


async def count_open_batches_on_tier(session: AsyncSession, name: str) -> int:
    """Batches at tier `name` that have not ended (their lines still run at it)."""
    return (
        await session.scalar(
            select(func.count()).where(BatchRow.tier == name, BatchRow.status.in_(ACTIVE_STATUSES))
        )
        or 0
    )


async def lock_tiers(session: AsyncSession) -> None:
    """Serialize this transaction with every other one that locks the tiers, until it
    ends: a check over all tiers (their min_share sum) then holds when it commits.
    Plain reads are not blocked."""
    if session.bind.dialect.name == "postgresql":
        await session.execute(text("LOCK TABLE tiers IN SHARE ROW EXCLUSIVE MODE"))
    else:
        # SQLite has one writer at a time: a write, even of no row, takes the lock now
        # instead of at the commit, when the check would already be stale.
        await session.execute(text("UPDATE tiers SET rank = rank WHERE 0"))


async def sum_min_share(session: AsyncSession, *, excluding: str | None = None) -> float:
    query = select(func.coalesce(func.sum(Tier.min_share), 0.0))
    if excluding is not None:
        query = query.where(Tier.name != excluding)
    return float(await session.scalar(query) or 0.0)


async def list_tenants(
    session: AsyncSession, *, limit: int, after: str | None = None
) -> list[Tenant]:
    """Tenants ordered by id; `after` is the last id of the previous page."""
    query = select(Tenant).order_by(Tenant.id).limit(limit)
    if after is not None:
        query = query.where(Tenant.id > after)
    return list((await session.scalars(query)).all())


async def get_tenant(session: AsyncSession, tenant_id: str) -> Tenant | None:
    return await session.get(Tenant, tenant_id)


async def get_tenant_by_name(session: AsyncSession, name: str) -> Tenant | None:
    return await session.scalar(select(Tenant).where(Tenant.name == name))


async def delete_tier(session: AsyncSession, name: str) -> bool:
    """Delete a tier; False if there was none (of deletes at once, one deletes the row).
    A tenant still on it fails the commit (IntegrityError)."""
    result = await session.execute(delete(Tier).where(Tier.name == name))
    return result.rowcount > 0


async def delete_tenant(session: AsyncSession, tenant_id: str) -> bool:
    """Delete a tenant and its keys; False if there was none."""
    await session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant_id))
    result = await session.execute(delete(Tenant).where(Tenant.id == tenant_id))
    return result.rowcount > 0


async def add_api_key(
    session: AsyncSession,
    *,
    tenant_id: str,
    digest: str,
    prefix: str,
    name: str = "",
    expires_at: datetime | None = None,
) -> ApiKey:
    key = ApiKey(tenant_id=tenant_id, digest=digest, prefix=prefix, name=name)
    key.expires_at = expires_at
    session.add(key)
    await session.flush()
    return key


async def list_api_keys(session: AsyncSession, tenant_id: str) -> list[ApiKey]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
    return list((await session.scalars(query)).all())


async def revoke_api_key(session: AsyncSession, key_id: str) -> ApiKey | None:
    """Mark a key revoked (idempotent: the first revocation time is kept)."""
    await session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    return await session.scalar(
        select(ApiKey).where(ApiKey.id == key_id).execution_options(populate_existing=True)
    )


def apply_changes(row: Any, changes: dict[str, Any]) -> None:
    for name, value in changes.items():
        setattr(row, name, value)
