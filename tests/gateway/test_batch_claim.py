"""Which batches a driver claims: round the tenants, at most `per_tenant` each, on both
databases."""

from __future__ import annotations

from gateway.batches.store import BatchStore
from gateway.db.models import Tenant


async def _tenant_with_batches(store: BatchStore, sessionmaker, name: str, n: int) -> list[str]:
    async with sessionmaker() as session:
        tenant = Tenant(name=name, tier="batch")
        session.add(tenant)
        await session.commit()
    upload = await store.create_file(tenant.id, purpose="batch", filename="a", content=b"{}")
    made = []
    for _ in range(n):
        batch = await store.create_batch(
            tenant.id,
            endpoint="/v1/chat/completions",
            input_file_id=upload.id,
            completion_window="24h",
            window_s=86_400,
            tier="batch",
            metadata=None,
        )
        made.append(batch.id)
    return made


async def test_one_claim_goes_round_the_tenants_and_keeps_the_cap(db_sessionmaker) -> None:
    store = BatchStore(db_sessionmaker)
    many = await _tenant_with_batches(store, db_sessionmaker, "many", 40)
    one = await _tenant_with_batches(store, db_sessionmaker, "one", 1)
    # Before, one claim counted "driven" as the query began: all of a tenant's batches
    # were at 0, and it took 32 of the 40 and none of the late tenant's.
    claimed = await store.claim("gw-a", 10.0, limit=32, per_tenant=4)
    assert sorted(claimed) == sorted(many[:4] + one)
    # Another gateway's claim leaves the tenant at its cap alone.
    assert await store.claim("gw-b", 10.0, limit=32, per_tenant=4) == []
    await store.release(many[0], "gw-a")
    assert await store.claim("gw-b", 10.0, limit=32, per_tenant=4) == [many[0]]
