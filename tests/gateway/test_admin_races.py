"""Admin writes racing each other on the same object, against real SQLite and PostgreSQL.

Each test fires many conflicting calls at once for a few rounds: a lost race must answer
as the same call made a moment later would (404 for an object gone, 409 for a tier in
use, 400 for an unknown tier), never a 500 nor a second delete that says it deleted.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.admin import AdminDeps
from gateway.auth import KeyAuthenticator
from gateway.tiers import TierCatalog
from tests.gateway.test_admin_api import ADMIN_TOKEN, _app

ROUNDS = 3
WIDTH = 12  # objects raced at once per round
KEYS = 6  # keys created per tenant while it is deleted


@pytest.fixture
async def client(db_sessionmaker) -> AsyncIterator[httpx.AsyncClient]:
    tiers = TierCatalog(db_sessionmaker, ttl_s=3600)
    deps = AdminDeps(db_sessionmaker, ADMIN_TOKEN, tiers, KeyAuthenticator(db_sessionmaker, tiers))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=_app(deps)),
        base_url="http://admin.test/admin/v1",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=60,
    ) as client:
        yield client


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _tenant(client: httpx.AsyncClient) -> str:
    response = await client.post("/tenants", json={"name": _name("t"), "tier": "batch"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def _tier(client: httpx.AsyncClient) -> str:
    name = _name("r")
    response = await client.post("/tiers", json={"name": name, "rank": 7})
    assert response.status_code == 201, response.text
    return name


def _pairs(firsts: list[Any], seconds: list[Any]) -> list[Any]:
    """firsts[0], seconds[0], firsts[1], ...: each pair starts side by side."""
    return [call for pair in zip(firsts, seconds, strict=True) for call in pair]


def _statuses(responses: list[httpx.Response]) -> Counter[int]:
    return Counter(r.status_code for r in responses)


def _code(response: httpx.Response) -> str | None:
    return response.json()["error"]["code"]


async def test_patch_racing_delete_is_404(client: httpx.AsyncClient) -> None:
    for _ in range(ROUNDS):
        tenants = [await _tenant(client) for _ in range(WIDTH)]
        tiers = [await _tier(client) for _ in range(WIDTH)]
        patches = [client.patch(f"/tenants/{t}", json={"weight": 2.0}) for t in tenants]
        patches += [client.patch(f"/tiers/{t}", json={"rpm": 9}) for t in tiers]
        deletes = [client.delete(f"/tenants/{t}") for t in tenants]
        deletes += [client.delete(f"/tiers/{t}") for t in tiers]
        replies = await asyncio.gather(*_pairs(patches, deletes))
        patched, deleted = replies[0::2], replies[1::2]
        assert set(_statuses(patched)) <= {200, 404}, [r.text for r in patched]
        assert _statuses(deleted) == {200: 2 * WIDTH}, [r.text for r in deleted]


async def test_deleting_a_tier_a_tenant_joins_meanwhile(client: httpx.AsyncClient) -> None:
    """One side wins: the tier goes and the tenant is refused the unknown tier, or the
    tenant lands there and the tier is in use."""
    for _ in range(ROUNDS):
        tiers = [await _tier(client) for _ in range(WIDTH)]
        movers = [await _tenant(client) for _ in range(WIDTH // 2)]
        deletes = [client.delete(f"/tiers/{t}") for t in tiers]
        joins = [
            client.post("/tenants", json={"name": _name("j"), "tier": t})
            for t in tiers[: WIDTH // 2]
        ]
        joins += [
            client.patch(f"/tenants/{m}", json={"tier": t})
            for m, t in zip(movers, tiers[WIDTH // 2 :], strict=True)
        ]
        # The delete first: the join then often checks the tier before it goes and
        # writes after.
        replies = await asyncio.gather(*_pairs(deletes, joins))
        for deleted, joined in zip(replies[0::2], replies[1::2], strict=True):
            if deleted.status_code == 200:
                assert joined.status_code == 400, joined.text
                error = joined.json()["error"]
                assert (error["code"], error["param"]) == ("unknown_tier", "tier")
            else:
                assert (deleted.status_code, _code(deleted)) == (409, "tier_in_use"), deleted.text
                assert joined.status_code in (200, 201), joined.text


async def test_creating_keys_racing_the_tenants_delete_is_404(
    client: httpx.AsyncClient,
) -> None:
    for _ in range(ROUNDS):
        tenants = [await _tenant(client) for _ in range(WIDTH)]
        calls = []
        for tenant_id in tenants:
            # The delete amid the creates: some read the tenant before it goes and
            # write their key after.
            keys = [client.post(f"/tenants/{tenant_id}/keys", json={}) for _ in range(KEYS)]
            calls += [
                *keys[: KEYS // 2],
                client.delete(f"/tenants/{tenant_id}"),
                *keys[KEYS // 2 :],
            ]
        replies = await asyncio.gather(*calls)
        deleted = replies[KEYS // 2 :: KEYS + 1]
        created = [r for i, r in enumerate(replies) if i % (KEYS + 1) != KEYS // 2]
        assert set(_statuses(created)) <= {201, 404}, [r.text for r in created]
        assert _statuses(deleted) == {200: WIDTH}, [r.text for r in deleted]
        for tenant_id in tenants:  # no key outlived its tenant
            assert (await client.get(f"/tenants/{tenant_id}/keys")).status_code == 404


async def test_concurrent_creates_of_one_name(client: httpx.AsyncClient) -> None:
    """Those that pass the name check together and lose at the unique index still say
    the name is taken (the race with a tier's delete answers otherwise, above)."""
    for _ in range(ROUNDS):
        name = _name("d")
        replies = await asyncio.gather(
            *(client.post("/tenants", json={"name": name, "tier": "batch"}) for _ in range(10))
        )
        assert _statuses(replies) == {201: 1, 409: 9}, [r.text for r in replies]
        for reply in replies:
            if reply.status_code == 409:
                assert reply.json()["error"]["param"] == "name", reply.text
                assert "already exists" in reply.json()["error"]["message"]


async def test_only_one_of_concurrent_deletes_succeeds(client: httpx.AsyncClient) -> None:
    for _ in range(ROUNDS):
        tenant_id = await _tenant(client)
        tier = await _tier(client)
        replies = await asyncio.gather(
            *(client.delete(f"/tenants/{tenant_id}") for _ in range(10)),
            *(client.delete(f"/tiers/{tier}") for _ in range(10)),
        )
        assert _statuses(replies[:10]) == {200: 1, 404: 9}, [r.text for r in replies[:10]]
        assert _statuses(replies[10:]) == {200: 1, 404: 9}, [r.text for r in replies[10:]]


async def test_concurrent_revokes_agree(client: httpx.AsyncClient) -> None:
    """Revoking is idempotent: every call answers 200 with the first revocation's time."""
    for _ in range(ROUNDS):
        tenant_id = await _tenant(client)
        key = await client.post(f"/tenants/{tenant_id}/keys", json={})
        assert key.status_code == 201, key.text
        replies = await asyncio.gather(
            *(client.delete(f"/keys/{key.json()['id']}") for _ in range(10))
        )
        assert _statuses(replies) == {200: 10}, [r.text for r in replies]
        assert len({r.json()["revoked_at"] for r in replies}) == 1
