"""Which batches a driver claims: round the tenants, at most `per_tenant` each, on both
databases (a batch only to be ended, first and past the cap); and a line's result stored
with its bill."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from gateway.batches.store import BatchStore
from gateway.db.batch_models import BatchLineRow, BatchRow
from gateway.db.models import Tenant, UsageRow, utcnow
from gateway.usage import UsageRecord


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


async def test_a_batch_to_end_is_claimed_past_the_tenants_cap(db_sessionmaker) -> None:
    # A waiting batch cancelled, or past its window, has nothing to run: ending it must
    # not wait until one of the tenant's running batches finishes (minutes, or hours).
    store = BatchStore(db_sessionmaker)
    made = await _tenant_with_batches(store, db_sessionmaker, "busy", 6)
    assert sorted(await store.claim("gw-a", 10.0, limit=32, per_tenant=4)) == sorted(made[:4])
    assert await store.claim("gw-b", 10.0, limit=32, per_tenant=4) == []
    assert await store.request_cancel(made[5])
    assert await store.claim("gw-b", 10.0, limit=32, per_tenant=4) == [made[5]]
    async with db_sessionmaker() as session, session.begin():
        batch = await session.get(BatchRow, made[4])
        batch.expires_at = utcnow() - timedelta(seconds=1)
    assert await store.claim("gw-b", 10.0, limit=32, per_tenant=4) == [made[4]]


async def test_a_lines_bill_is_stored_with_its_result_and_only_once(db_sessionmaker) -> None:
    store = BatchStore(db_sessionmaker)
    (batch_id,) = await _tenant_with_batches(store, db_sessionmaker, "billed", 1)
    async with db_sessionmaker() as session, session.begin():
        session.add(BatchLineRow(batch_id=batch_id, line_index=0, custom_id="a", body="{}"))
    bill = UsageRecord(
        "req_line", "ten", "batch", "m", 5, 7, 1.0, 10.0, 20.0, "ok", datetime.now(UTC)
    )
    finish = {"is_success": True, "result_json": "{}", "usage": bill}
    assert await store.finish_line(batch_id, 0, **finish)
    # A second run of the line (another gateway took it over) stores and bills nothing.
    assert not await store.finish_line(batch_id, 0, **finish)
    async with db_sessionmaker() as session:
        rows = (await session.scalars(select(UsageRow))).all()
    assert [(r.request_id, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        ("req_line", 5, 7)
    ]
