"""Demo tenants for `tiergate serve --demo`: one per built-in tier, each with a fresh key.

Idempotent: a rerun reuses the tenants (named `demo-<tier>`) and mints a new key for
each, since a secret cannot be recovered from its stored digest.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.auth import generate_api_key
from gateway.db import repo
from gateway.db.models import Tenant

DEMO_TIERS = ("priority", "interactive", "batch")


@dataclass(frozen=True)
class DemoTenant:
    name: str
    tier: str
    api_key: str


async def _get_or_create_tenant(
    sessionmaker: async_sessionmaker, name: str, tier: str
) -> tuple[str, str]:
    """(tenant id, its tier): an existing tenant keeps the tier an admin gave it."""
    async with sessionmaker() as session:
        tenant = await repo.get_tenant_by_name(session, name)
        if tenant is not None:
            return tenant.id, tenant.tier
        tenant = Tenant(name=name, tier=tier, weight=1.0, status="active")
        session.add(tenant)
        try:
            await session.commit()
            return tenant.id, tier
        except IntegrityError:  # created concurrently by another process: use that one
            await session.rollback()
    async with sessionmaker() as session:
        existing = await repo.get_tenant_by_name(session, name)
        if existing is None:
            raise RuntimeError(f"could not create demo tenant {name!r}")
        return existing.id, existing.tier


async def ensure_demo_tenants(sessionmaker: async_sessionmaker) -> list[DemoTenant]:
    """One demo tenant per built-in tier that exists, each with a newly minted key."""
    async with sessionmaker() as session:
        tiers = [t for t in DEMO_TIERS if await repo.get_tier(session, t) is not None]
    demos = []
    for tier in tiers:
        name = f"demo-{tier}"
        tenant_id, tier_now = await _get_or_create_tenant(sessionmaker, name, tier)
        secret, digest, prefix = generate_api_key()
        async with sessionmaker() as session:
            await repo.add_api_key(
                session, tenant_id=tenant_id, digest=digest, prefix=prefix, name="demo"
            )
            await session.commit()
        demos.append(DemoTenant(name=name, tier=tier_now, api_key=secret))
    return demos
