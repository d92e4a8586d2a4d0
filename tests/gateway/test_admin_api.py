"""Admin API against real SQLite and PostgreSQL, through the ASGI app of its routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.admin import AdminDeps, admin_routes
from gateway.auth import KeyAuthenticator
from gateway.errors import AuthenticationError, PermissionDeniedError
from gateway.tiers import TierCatalog

ADMIN_TOKEN = "admin-secret-token"


@dataclass
class Admin:
    client: httpx.AsyncClient
    auth: KeyAuthenticator
    tiers: TierCatalog
    transport: httpx.ASGITransport

    async def create_tenant(self, name: str = "acme", tier: str = "interactive", **extra):
        response = await self.client.post(
            "/admin/v1/tenants", json={"name": name, "tier": tier, **extra}
        )
        assert response.status_code == 201, response.text
        return response.json()

    async def create_key(self, tenant_id: str, **body) -> dict:
        response = await self.client.post(f"/admin/v1/tenants/{tenant_id}/keys", json=body)
        assert response.status_code == 201, response.text
        return response.json()


def _app(deps: AdminDeps) -> Starlette:
    return Starlette(routes=[Mount("/admin/v1", routes=admin_routes(deps))])


@pytest.fixture
async def admin(db_sessionmaker) -> AsyncIterator[Admin]:
    # Long TTLs: anything seen fresh below is due to invalidation, not expiry.
    tiers = TierCatalog(db_sessionmaker, ttl_s=3600)
    auth = KeyAuthenticator(db_sessionmaker, tiers, cache_ttl_s=3600)
    deps = AdminDeps(db_sessionmaker, ADMIN_TOKEN, tiers, auth)
    transport = httpx.ASGITransport(app=_app(deps))
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://admin.test",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as client:
        yield Admin(client, auth, tiers, transport)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# Each table below runs in one test per database: a fresh database per row would cost
# more than the rows themselves.
BAD_ADMIN_HEADERS = [
    {},
    {"authorization": "Bearer wrong"},
    {"authorization": f"Basic {ADMIN_TOKEN}"},
    {"authorization": ADMIN_TOKEN},
    {"authorization": "Bearer"},
    {"authorization": "Bearer é-not-ascii".encode("latin-1")},
]


async def test_admin_token_required(admin: Admin) -> None:
    for headers in BAD_ADMIN_HEADERS:
        async with httpx.AsyncClient(
            transport=admin.transport, base_url="http://admin.test", headers=headers
        ) as client:
            for method, path in [("GET", "/tiers"), ("POST", "/tenants"), ("DELETE", "/keys/x")]:
                response = await client.request(method, f"/admin/v1{path}", json={})
                error = _assert_error(response, 401)
                assert error["type"] == "authentication_error"


async def test_empty_admin_token_disables_admin_api(db_sessionmaker) -> None:
    tiers = TierCatalog(db_sessionmaker)
    deps = AdminDeps(db_sessionmaker, "", tiers, KeyAuthenticator(db_sessionmaker, tiers))
    transport = httpx.ASGITransport(app=_app(deps))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for auth in ("Bearer ", "Bearer", ""):
            response = await client.get("/admin/v1/tiers", headers={"authorization": auth})
            _assert_error(response, 401)


async def test_tier_lifecycle(admin: Admin) -> None:
    listed = (await admin.client.get("/admin/v1/tiers")).json()
    assert [t["name"] for t in listed["data"]] == ["priority", "interactive", "batch"]
    # Only the throughput tier is capped out of the box (migration 0006).
    assert [t["max_queued_jobs"] for t in listed["data"]] == [None, None, 10_000]

    body = {"name": "gold", "rank": 0, "ttft_slo_ms": 250, "rpm": 1000, "min_share": 0.2}
    created = await admin.client.post("/admin/v1/tiers", json=body)
    assert created.status_code == 201, created.text
    gold = created.json()
    assert gold["ttft_slo_ms"] == 250.0
    assert gold["preemptible"] is False
    assert gold["tpm"] is None
    assert gold["max_queued_jobs"] is None  # no cap unless one is set
    assert (await admin.tiers.get("gold")).rpm == 1000  # catalog invalidated

    duplicate = await admin.client.post("/admin/v1/tiers", json=body)
    _assert_error(duplicate, 409)

    patched = await admin.client.patch("/admin/v1/tiers/gold", json={"rpm": None, "rank": 3})
    assert patched.status_code == 200, patched.text
    assert patched.json()["rpm"] is None
    assert (await admin.tiers.get("gold")).rank == 3

    capped = await admin.client.patch("/admin/v1/tiers/gold", json={"max_queued_jobs": 50})
    assert capped.status_code == 200, capped.text
    assert capped.json()["max_queued_jobs"] == 50
    assert (await admin.tiers.get("gold")).max_queued_jobs == 50
    assert (await admin.client.get("/admin/v1/tiers/gold")).json()["max_queued_jobs"] == 50
    bad = await admin.client.patch("/admin/v1/tiers/gold", json={"max_queued_jobs": 0})
    _assert_error(bad, 400, param="max_queued_jobs")
    uncapped = await admin.client.patch("/admin/v1/tiers/gold", json={"max_queued_jobs": None})
    assert uncapped.json()["max_queued_jobs"] is None
    assert (await admin.tiers.get("gold")).max_queued_jobs is None

    _assert_error(await admin.client.patch("/admin/v1/tiers/gold", json={"name": "x"}), 400)
    assert (await admin.client.get("/admin/v1/tiers/gold")).json()["rank"] == 3

    deleted = await admin.client.delete("/admin/v1/tiers/gold")
    assert deleted.status_code == 200
    _assert_error(await admin.client.get("/admin/v1/tiers/gold"), 404)
    _assert_error(await admin.client.delete("/admin/v1/tiers/gold"), 404)
    assert [t.name for t in await admin.tiers.all()] == ["priority", "interactive", "batch"]


async def test_deleting_a_tier_in_use_is_409(admin: Admin) -> None:
    tenant = await admin.create_tenant(tier="batch")
    error = _assert_error(await admin.client.delete("/admin/v1/tiers/batch"), 409)
    assert error["code"] == "tier_in_use"
    assert (await admin.client.get("/admin/v1/tiers/batch")).status_code == 200
    await admin.client.delete(f"/admin/v1/tenants/{tenant['id']}")
    assert (await admin.client.delete("/admin/v1/tiers/batch")).status_code == 200


async def test_min_share_over_all_tiers_may_not_exceed_one(admin: Admin) -> None:
    # Seeded tiers hold 0.15 between them.
    response = await admin.client.post(
        "/admin/v1/tiers", json={"name": "greedy", "rank": 5, "min_share": 0.9}
    )
    _assert_error(response, 400, param="min_share")
    patch = await admin.client.patch("/admin/v1/tiers/batch", json={"min_share": 0.9})
    assert patch.status_code == 200, patch.text


async def test_concurrent_share_changes_cannot_push_the_sum_past_one(admin: Admin) -> None:
    """Eight changes at once, each fitting alone: the check and the write of each are
    one step, so those that would push the sum past 1 are refused."""
    import asyncio

    for i in range(8):
        created = await admin.client.post(
            "/admin/v1/tiers", json={"name": f"ms{i}", "rank": 10 + i}
        )
        assert created.status_code == 201, created.text
    replies = await asyncio.gather(
        *(admin.client.patch(f"/admin/v1/tiers/ms{i}", json={"min_share": 0.4}) for i in range(8))
    )
    assert sorted(r.status_code for r in replies) == [200, 200] + [400] * 6
    tiers = (await admin.client.get("/admin/v1/tiers")).json()["data"]
    assert sum(t["min_share"] for t in tiers) <= 1.0 + 1e-9


async def test_a_tiny_weight_is_refused(admin: Admin) -> None:
    """The queue divides charges by the weight: near zero, a counter would overflow."""
    response = await admin.client.post(
        "/admin/v1/tenants", json={"name": "tiny", "tier": "batch", "weight": 5e-324}
    )
    _assert_error(response, 400, param="weight")
    await admin.create_tenant("small", "batch", weight=0.001)


BAD_BODIES = [
    ("/tiers", b"{not json", None),
    ("/tiers", b"[1, 2]", None),
    ("/tiers", b'"a string"', None),
    ("/tiers", b'{"name": "\xff\xfe", "rank": 1}', None),
    ("/tiers", b'{"name": "x", "rank": NaN}', None),
    ("/tiers", b'{"name": "x", "rank": 1, "ttft_slo_ms": Infinity}', None),
    ("/tiers", b'{"rank": 1}', "name"),
    ("/tiers", b'{"name": "x"}', "rank"),
    ("/tiers", b'{"name": "x", "rank": 1, "colour": "red"}', "colour"),
    ("/tiers", b'{"name": "x", "rank": "1"}', "rank"),
    ("/tiers", b'{"name": "x", "rank": true}', "rank"),
    ("/tiers", b'{"name": "x", "rank": 1.5}', "rank"),
    ("/tiers", b'{"name": "x", "rank": -1}', "rank"),
    ("/tiers", b'{"name": "x", "rank": 1, "rpm": 99999999999999}', "rpm"),
    ("/tiers", b'{"name": "x", "rank": 1, "rpm": 0}', "rpm"),
    ("/tiers", b'{"name": "x", "rank": 1, "ttft_slo_ms": 0}', "ttft_slo_ms"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": 0}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": -3}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": 2.5}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": "10"}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": true}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "max_queued_jobs": 4294967296}', "max_queued_jobs"),
    ("/tiers", b'{"name": "x", "rank": 1, "min_share": 1}', "min_share"),
    ("/tiers", b'{"name": "x", "rank": 1, "preemptible": 1}', "preemptible"),
    ("/tiers", b'{"name": "x", "rank": 1, "price_input_per_mtok": -1}', None),
    # Beyond any model's price; at 1e12 one 10,000-token request overflowed its record.
    ("/tiers", b'{"name": "x", "rank": 1, "price_output_per_mtok": 1000001}', None),
    ("/tiers", b'{"name": "Has Space", "rank": 1}', "name"),
    ("/tiers", b'{"name": "' + b"x" * 40 + b'", "rank": 1}', "name"),
    ("/tiers", b'{"name": "x", "rank": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("/tenants", b'{"name": "a\\u0000b", "tier": "batch"}', "name"),
    ("/tenants", b'{"name": "' + b"n" * 101 + b'", "tier": "batch"}', "name"),
    ("/tenants", b'{"name": "", "tier": "batch"}', "name"),
    ("/tenants", b'{"name": "   ", "tier": "batch"}', "name"),
    ("/tenants", b'{"name": " \\u00a0\\u3000", "tier": "batch"}', "name"),
    ("/tenants", b'{"name": "a", "tier": "nope"}', "tier"),
    ("/tenants", b'{"name": "a", "tier": "batch", "weight": 0}', "weight"),
    ("/tenants", b'{"name": "a", "tier": "batch", "status": "gone"}', "status"),
    ("/tenants", b'{"name": "a", "tier": "batch", "tpm": -5}', "tpm"),
    ("/tenants", b'{"name": 7, "tier": "batch"}', "name"),
]


async def test_bad_bodies_are_400(admin: Admin) -> None:
    for path, content, param in BAD_BODIES:
        response = await admin.client.post(
            f"/admin/v1{path}", content=content, headers={"content-type": "application/json"}
        )
        status = 400 if len(content) < 64 * 1024 else 413
        error = _assert_error(response, status, param=param)
        assert error["type"] == "invalid_request_error", content[:80]
    # Nothing was created by any of them.
    assert len((await admin.client.get("/admin/v1/tiers")).json()["data"]) == 3
    assert (await admin.client.get("/admin/v1/tenants")).json()["data"] == []


async def test_a_repeated_key_is_400_not_the_last_value(admin: Admin) -> None:
    """json.loads keeps the last of two equal keys: the tenant created would be one that a
    reader of the body's first "name" and "tier" does not expect."""
    headers = {"content-type": "application/json"}
    created = await admin.client.post(
        "/admin/v1/tenants",
        content=b'{"name": "dupkey-a", "tier": "batch", "name": "dupkey-b", "tier": "interactive"}',
        headers=headers,
    )
    error = _assert_error(created, 400)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert "'name'" in error["message"]
    assert (await admin.client.get("/admin/v1/tenants")).json()["data"] == []

    tenant = await admin.create_tenant("dupkey", "batch")
    patched = await admin.client.patch(
        f"/admin/v1/tenants/{tenant['id']}", content=b'{"weight": 2, "weight": 9}', headers=headers
    )
    assert "'weight'" in _assert_error(patched, 400)["message"]
    read = await admin.client.get(f"/admin/v1/tenants/{tenant['id']}")
    assert read.json()["weight"] == tenant["weight"]


INVISIBLE_NAMES = [
    "\u200b",  # zero-width space (Cf): str.strip() keeps it
    "\u2060\u200d",  # word joiner, zero-width joiner
    "\ufeff",  # zero-width no-break space (BOM)
    " \u200b\u2028 ",  # spaces, a line separator
    "\u3164",  # Hangul filler: a letter drawn blank
    "\u2800",  # the empty braille cell
    "\u0301\ufe0f",  # combining marks with no base
    "\ue000",  # private use
    "\U000e0061\U000e0062",  # tag characters
]
# Embeddings, overrides and isolates show a name as other text ("\u202eemca" reads "acme").
BIDI_NAMES = ["\u202e", "\u202eemca", "acme\u202a", "x\u2066y\u2069", "\u2067\u05d0\u2069"]
# Visible names that hold format characters or marks where scripts and emoji need them.
VISIBLE_NAMES = [
    "Zoe\u0308",  # e and a combining diaeresis
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",  # emoji joined by ZWJ
    "\u05e9\u05dc\u05d5\u05dd\u200e acme",  # Hebrew, a left-to-right mark
    "\u0645\u06cc\u200c\u0634\u0648\u062f",  # Persian with a zero-width non-joiner
]


async def test_names_without_a_visible_character_or_with_bidi_controls_are_400(
    admin: Admin,
) -> None:
    tenant = await admin.create_tenant("visible", "batch")
    for name in INVISIBLE_NAMES + BIDI_NAMES:
        created = await admin.client.post("/admin/v1/tenants", json={"name": name, "tier": "batch"})
        _assert_error(created, 400, param="name")
        renamed = await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"name": name})
        _assert_error(renamed, 400, param="name")
        key = await admin.client.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": name})
        _assert_error(key, 400, param="name")
    bidi = await admin.client.post("/admin/v1/tenants", json={"name": "a\u202eb", "tier": "batch"})
    assert "bidirectional" in _assert_error(bidi, 400, param="name")["message"]
    listed = (await admin.client.get("/admin/v1/tenants")).json()["data"]
    assert [t["name"] for t in listed] == ["visible"]
    assert (await admin.client.get(f"/admin/v1/tenants/{tenant['id']}/keys")).json()["data"] == []

    for name in VISIBLE_NAMES:
        assert (await admin.create_tenant(name, "batch"))["name"] == name
        await admin.create_key(tenant["id"], name=name)


UNKNOWN_OBJECTS = [
    ("GET PATCH DELETE", "/tiers/%00"),
    ("GET PATCH DELETE", "/tiers/NOPE"),
    ("GET PATCH DELETE", "/tenants/ten_000000000000000000000000"),
    ("GET PATCH DELETE", "/tenants/%00bad"),
    ("GET PATCH DELETE", "/tenants/" + "x" * 500),
    ("GET POST", "/tenants/ten_000000000000000000000000/keys"),
    ("DELETE", "/keys/key_000000000000000000000000"),
    ("DELETE", "/keys/%00"),
]


async def test_unknown_objects_are_404(admin: Admin) -> None:
    for methods, path in UNKNOWN_OBJECTS:
        for method in methods.split():
            body = {} if method in ("PATCH", "POST") else None
            response = await admin.client.request(method, f"/admin/v1{path}", json=body)
            _assert_error(response, 404)


async def test_tenant_lifecycle(admin: Admin) -> None:
    tenant = await admin.create_tenant("acme", "interactive", rpm=5)
    assert tenant["id"].startswith("ten_")
    assert (tenant["weight"], tenant["status"], tenant["rpm"]) == (1.0, "active", 5)
    _assert_error(
        await admin.client.post("/admin/v1/tenants", json={"name": "acme", "tier": "batch"}),
        409,
    )
    fetched = (await admin.client.get(f"/admin/v1/tenants/{tenant['id']}")).json()
    assert fetched == tenant

    patched = await admin.client.patch(
        f"/admin/v1/tenants/{tenant['id']}", json={"tier": "batch", "weight": 2.5, "rpm": None}
    )
    assert patched.status_code == 200, patched.text
    assert (patched.json()["tier"], patched.json()["weight"], patched.json()["rpm"]) == (
        "batch",
        2.5,
        None,
    )
    _assert_error(
        await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"tier": "nope"}),
        400,
        param="tier",
    )
    _assert_error(
        await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"name": "  "}),
        400,
        param="name",
    )
    other = await admin.create_tenant("other", "batch")
    _assert_error(
        await admin.client.patch(f"/admin/v1/tenants/{other['id']}", json={"name": "acme"}), 409
    )

    key = await admin.create_key(tenant["id"])
    deleted = await admin.client.delete(f"/admin/v1/tenants/{tenant['id']}")
    assert deleted.status_code == 200
    _assert_error(await admin.client.get(f"/admin/v1/tenants/{tenant['id']}"), 404)
    _assert_error(await admin.client.delete(f"/admin/v1/keys/{key['id']}"), 404)  # cascaded
    with pytest.raises(AuthenticationError):
        await admin.auth.authenticate(f"Bearer {key['secret']}")


async def test_tenant_list_pages(admin: Admin) -> None:
    ids = sorted([(await admin.create_tenant(f"t{i}", "batch"))["id"] for i in range(5)])
    first = (await admin.client.get("/admin/v1/tenants", params={"limit": 2})).json()
    assert [t["id"] for t in first["data"]] == ids[:2]
    assert first["has_more"] is True
    rest = (
        await admin.client.get("/admin/v1/tenants", params={"limit": 10, "after": first["last_id"]})
    ).json()
    assert [t["id"] for t in rest["data"]] == ids[2:]
    assert rest["has_more"] is False
    for params in ({"limit": 0}, {"limit": "x"}, {"limit": 5000}, {"after": "zzz"}):
        _assert_error(await admin.client.get("/admin/v1/tenants", params=params), 400)


async def test_keys_secret_once_and_revocation_is_immediate(admin: Admin) -> None:
    tenant = await admin.create_tenant("acme", "priority")
    key = await admin.create_key(tenant["id"], name="ci")
    assert key["secret"].startswith("tg-")
    assert key["prefix"] == key["secret"][: len(key["prefix"])]
    principal = await admin.auth.authenticate(f"Bearer {key['secret']}")
    assert (principal.tenant_id, principal.key_id, principal.tier.name) == (
        tenant["id"],
        key["id"],
        "priority",
    )

    listed = (await admin.client.get(f"/admin/v1/tenants/{tenant['id']}/keys")).json()["data"]
    assert [k["id"] for k in listed] == [key["id"]]
    assert "secret" not in listed[0]
    assert key["secret"] not in str(listed)
    assert "digest" not in listed[0]

    revoked = await admin.client.delete(f"/admin/v1/keys/{key['id']}")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    # The authenticator cached the key for an hour; revocation still applies at once.
    with pytest.raises(AuthenticationError, match="revoked"):
        await admin.auth.authenticate(f"Bearer {key['secret']}")
    again = await admin.client.delete(f"/admin/v1/keys/{key['id']}")
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]


async def test_tenant_changes_apply_at_once(admin: Admin) -> None:
    tenant = await admin.create_tenant("acme", "interactive")
    key = await admin.create_key(tenant["id"])
    header = f"Bearer {key['secret']}"
    assert (await admin.auth.authenticate(header)).rpm == 300  # the tier's default

    await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"rpm": 7, "weight": 3})
    principal = await admin.auth.authenticate(header)
    assert (principal.rpm, principal.weight) == (7, 3.0)

    await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"status": "suspended"})
    with pytest.raises(PermissionDeniedError):
        await admin.auth.authenticate(header)
    await admin.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"status": "active"})
    await admin.client.patch("/admin/v1/tiers/interactive", json={"tpm": 11})
    assert (await admin.auth.authenticate(header)).tpm == 11


async def test_key_expiry_fields(admin: Admin) -> None:
    tenant = await admin.create_tenant()
    key = await admin.create_key(tenant["id"], expires_at="2999-01-01T00:00:00Z")
    assert key["expires_at"].startswith("2999-01-01T00:00:00")
    assert (await admin.auth.authenticate(f"Bearer {key['secret']}")).tenant_id == tenant["id"]
    soon = datetime.now(UTC) + timedelta(seconds=0.3)
    short = await admin.create_key(tenant["id"], expires_at=soon.isoformat())
    await admin.auth.authenticate(f"Bearer {short['secret']}")
    await asyncio.sleep(0.4)
    with pytest.raises(AuthenticationError, match="expired"):
        await admin.auth.authenticate(f"Bearer {short['secret']}")
    in_s = await admin.create_key(tenant["id"], expires_in_s=60)
    assert in_s["expires_at"] is not None
    assert (await admin.client.post(f"/admin/v1/tenants/{tenant['id']}/keys")).status_code == 201
    for body in (
        {"expires_at": "tomorrow"},
        {"expires_at": "2999-01-01T00:00:00"},  # no time zone
        {"expires_in_s": 0},
        {"expires_at": "2001-01-01T00:00:00+02:00"},  # a key born expired
        {"expires_at": None, "expires_in_s": 5},
        {"secret": "tg-mine"},
    ):
        response = await admin.client.post(f"/admin/v1/tenants/{tenant['id']}/keys", json=body)
        _assert_error(response, 400)
