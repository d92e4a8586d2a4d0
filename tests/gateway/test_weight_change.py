"""A tenant's weight change through the admin API reaches the jobs it already queued, on
the in-memory queue and on the Redis queue a fleet shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from engine.request import SamplingParams
from gateway.admin import AdminDeps, admin_routes
from gateway.auth import KeyAuthenticator
from gateway.tiers import TierCatalog
from scheduler.backend import QueueBackend
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend

ADMIN_TOKEN = "admin-secret-token"
TIERS = [TierConfig("priority", rank=0), TierConfig("interactive", rank=1)]


@dataclass
class Admin:
    client: httpx.AsyncClient
    queue: QueueBackend

    async def create_tenant(self, name: str) -> str:
        response = await self.client.post(
            "/admin/v1/tenants", json={"name": name, "tier": "interactive"}
        )
        assert response.status_code == 201, response.text
        return response.json()["id"]

    async def patch_tenant(self, tenant_id: str, **changes) -> dict:
        response = await self.client.patch(f"/admin/v1/tenants/{tenant_id}", json=changes)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(params=["memory", "redis"])
async def admin(request, db_sessionmaker, redis_url, redis_prefix) -> AsyncIterator[Admin]:
    if request.param == "memory":
        queue: QueueBackend = MemoryBackend(TIERS)
    else:
        queue = RedisBackend.from_url(redis_url, keys=KeySpace(redis_prefix))
        await queue.configure_tiers(TIERS)
    tiers = TierCatalog(db_sessionmaker)
    deps = AdminDeps(
        db_sessionmaker, ADMIN_TOKEN, tiers, KeyAuthenticator(db_sessionmaker, tiers), queue=queue
    )
    app = Starlette(routes=[Mount("/admin/v1", routes=admin_routes(deps))])
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://admin.test",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as client:
            yield Admin(client, queue)
    finally:
        await queue.aclose()


def _job(tenant_id: str, weight: float) -> Job:
    return Job(
        job_id=f"{tenant_id}-job",
        tenant_id=tenant_id,
        tier="interactive",
        rank=1,
        weight=weight,
        prompt_token_ids=tuple(range(1, 11)),
        params=SamplingParams(max_tokens=4),
        arrival_s=1_700_000_000.0,
    )


async def test_a_weight_patch_reaches_the_queued_jobs(admin: Admin) -> None:
    tenant_id = await admin.create_tenant("acme")
    await admin.queue.enqueue(_job(tenant_id, 1.0))  # queued at the weight then known
    assert (await admin.patch_tenant(tenant_id, weight=4))["weight"] == 4.0
    assert await admin.queue.tenant_weight(tenant_id) == 4.0
    await admin.patch_tenant(tenant_id, rpm=100)  # no weight in it: the queue keeps 4
    assert await admin.queue.tenant_weight(tenant_id) == 4.0
    # The job queued at weight 1 is charged its 10 prompt tokens at 4.
    assert await admin.queue.dispatch("w1", 5_000) is not None
    assert (await admin.queue.counters("interactive"))[tenant_id] == 10 / 4


async def test_a_weight_patch_for_a_tenant_without_jobs_stores_nothing(admin: Admin) -> None:
    tenant_id = await admin.create_tenant("idle")
    assert (await admin.patch_tenant(tenant_id, weight=2.5))["weight"] == 2.5
    # Its next job brings the weight with it; the queue keeps none for idle tenants.
    assert await admin.queue.tenant_weight(tenant_id) is None


async def test_a_stale_enqueue_does_not_undo_a_weight_patch(admin: Admin, monkeypatch) -> None:
    # A gateway that has not heard of the change yet enqueues with the old weight and
    # sets it back for the whole backlog; the PATCH is applied again once every gateway
    # knows it (here after 0.2 s instead of 1.5 s and 5 s).
    from gateway.admin import routes

    monkeypatch.setattr(routes, "WEIGHT_REAPPLY_S", (0.2,))
    tenant_id = await admin.create_tenant("stale")
    await admin.queue.enqueue(_job(tenant_id, 1.0))
    await admin.patch_tenant(tenant_id, weight=4)
    await admin.queue.enqueue(replace(_job(tenant_id, 1.0), job_id="stale-job"))
    assert await admin.queue.tenant_weight(tenant_id) == 1.0  # undone...
    await asyncio.sleep(0.4)
    assert await admin.queue.tenant_weight(tenant_id) == 4.0  # ...and applied again
