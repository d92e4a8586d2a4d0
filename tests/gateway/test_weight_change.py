"""A tenant's weight change through the admin API reaches the jobs it already queued, on
the in-memory queue and on the Redis queue a fleet shares."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from engine.request import SamplingParams
from gateway.admin import AdminDeps, admin_routes
from gateway.admin.routes import WEIGHT_REAPPLY_S, WeightReapplier
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
    # knows it (here after 0.2 s instead of WEIGHT_REAPPLY_S).
    from gateway.admin import routes

    monkeypatch.setattr(routes, "WEIGHT_REAPPLY_S", (0.2,))
    tenant_id = await admin.create_tenant("stale")
    await admin.queue.enqueue(_job(tenant_id, 1.0))
    await admin.patch_tenant(tenant_id, weight=4)
    await admin.queue.enqueue(replace(_job(tenant_id, 1.0), job_id="stale-job"))
    assert await admin.queue.tenant_weight(tenant_id) == 1.0  # undone...
    # ...and applied again: after 0.2 s, and the database read and queue call it makes
    # (seconds on a loaded machine, which a fixed 0.4 s wait did not allow for).
    deadline = time.monotonic() + 10
    for _ in itertools.count():
        weight = await admin.queue.tenant_weight(tenant_id)
        if weight == 4.0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert weight == 4.0


class FakeClock:
    """Virtual time for WeightReapplier: `advance_to` wakes the sleepers in time order and
    lets each run until it sleeps again or ends, so a schedule plays out the same however
    loaded the machine is."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None], asyncio.Task]] = []
        self._order = itertools.count()
        self._slept: asyncio.Future[None] | None = None

    @property
    def num_sleepers(self) -> int:
        return len(self._sleepers)

    async def sleep(self, delay_s: float) -> None:
        wake = asyncio.get_running_loop().create_future()
        task = asyncio.current_task()
        heapq.heappush(self._sleepers, (self.now_s + delay_s, next(self._order), wake, task))
        if self._slept is not None and not self._slept.done():
            self._slept.set_result(None)
        await wake

    async def advance_to(self, at_s: float) -> None:
        # A task started since the last call runs first (it was scheduled before this
        # one yields), up to its first sleep.
        await asyncio.sleep(0)
        while self._sleepers and self._sleepers[0][0] <= at_s:
            self.now_s, _, wake, task = heapq.heappop(self._sleepers)
            self._slept = asyncio.get_running_loop().create_future()
            wake.set_result(None)
            await asyncio.wait({self._slept, task}, return_when=asyncio.FIRST_COMPLETED)
        self.now_s = at_s


@pytest.mark.parametrize("stale_at_s", [0.0, 0.17, 0.45, 0.85])
async def test_a_stale_enqueue_soon_after_a_weight_patch_is_undone_within_a_second(
    admin: Admin, stale_at_s: float
) -> None:
    # Seen with two gateways: an enqueue through the one whose cache still held weight 1,
    # 0.17 s after the PATCH, kept the queue at 1 until the re-apply at 1.5 s. Gateways
    # drop their caches within a poll (250 ms) of the change; a request that
    # authenticated just before may enqueue a little later.
    clock = FakeClock()
    reapplier = WeightReapplier(admin.queue, sleep=clock.sleep)
    tenant_id = "ten_stale"
    await admin.queue.enqueue(_job(tenant_id, 1.0))
    await reapplier.apply(tenant_id, 5.0)
    assert await admin.queue.tenant_weight(tenant_id) == 5.0
    await clock.advance_to(stale_at_s)
    await admin.queue.enqueue(replace(_job(tenant_id, 1.0), job_id="stale-job"))
    assert await admin.queue.tenant_weight(tenant_id) == 1.0
    await clock.advance_to(1.0)
    assert await admin.queue.tenant_weight(tenant_id) == 5.0  # "within a second"
    await clock.advance_to(60.0)
    assert await admin.queue.tenant_weight(tenant_id) == 5.0
    assert clock.num_sleepers == 0


async def test_an_earlier_patchs_reapply_does_not_undo_a_later_patch(admin: Admin) -> None:
    clock = FakeClock()
    reapplier = WeightReapplier(admin.queue, sleep=clock.sleep)
    tenant_id = "ten_twice"
    await admin.queue.enqueue(_job(tenant_id, 1.0))
    await reapplier.apply(tenant_id, 5.0)
    await clock.advance_to(0.3)
    await reapplier.apply(tenant_id, 2.0)  # corrected 0.3 s later
    # Just after every point of either PATCH's schedule.
    for at_s in sorted({*WEIGHT_REAPPLY_S, *(0.3 + s for s in WEIGHT_REAPPLY_S)}):
        await clock.advance_to(at_s + 0.01)
        assert await admin.queue.tenant_weight(tenant_id) == 2.0, at_s
    await clock.advance_to(60.0)
    assert clock.num_sleepers == 0


async def test_a_later_patch_through_another_gateway_is_not_undone(admin: Admin) -> None:
    # Two gateways' admin routes, each with its own re-applies: the first PATCH's set the
    # weight committed at the time they run, which is the second PATCH's.
    clock = FakeClock()
    committed: dict[str, float] = {}

    async def read_weight(tenant_id: str) -> float | None:
        return committed.get(tenant_id)

    first = WeightReapplier(admin.queue, read_weight=read_weight, sleep=clock.sleep)
    second = WeightReapplier(admin.queue, read_weight=read_weight, sleep=clock.sleep)
    tenant_id = "ten_two_gateways"
    await admin.queue.enqueue(_job(tenant_id, 1.0))
    committed[tenant_id] = 5.0
    await first.apply(tenant_id, 5.0)
    await clock.advance_to(0.3)
    committed[tenant_id] = 2.0
    await second.apply(tenant_id, 2.0)
    for at_s in sorted({*WEIGHT_REAPPLY_S, *(0.3 + s for s in WEIGHT_REAPPLY_S)}):
        await clock.advance_to(at_s + 0.01)
        assert await admin.queue.tenant_weight(tenant_id) == 2.0, at_s
    # A tenant deleted meanwhile: its re-applies stop without writing.
    del committed[tenant_id]
    await first.apply(tenant_id, 7.0)
    await admin.queue.set_tenant_weight(tenant_id, 3.0)
    await clock.advance_to(120.0)
    assert await admin.queue.tenant_weight(tenant_id) == 3.0
    assert clock.num_sleepers == 0
