"""API keys: format, storage only as digests, authentication outcomes, caching."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, event, inspect, select, text, update

from gateway.auth import KeyAuthenticator, generate_api_key
from gateway.db import repo
from gateway.db.models import ApiKey, Tenant, Tier
from gateway.demo import ensure_demo_tenants
from gateway.errors import AuthenticationError, PermissionDeniedError
from gateway.tiers import TierCatalog


def test_generated_keys() -> None:
    keys = [generate_api_key() for _ in range(200)]
    secrets = {secret for secret, _, _ in keys}
    assert len(secrets) == len(keys)
    for secret, digest, prefix in keys:
        assert secret.startswith("tg-")
        raw = base64.urlsafe_b64decode(secret[3:] + "=" * (-len(secret[3:]) % 4))
        assert len(raw) >= 32
        assert digest == hashlib.sha256(secret.encode()).hexdigest()
        assert secret.startswith(prefix)
        assert 3 < len(prefix) <= 12  # shows which key, reveals almost nothing


async def _tenant_with_key(
    sessionmaker, *, tier: str = "interactive", status: str = "active", **key_fields
) -> tuple[Tenant, ApiKey, str]:
    secret, digest, prefix = generate_api_key()
    async with sessionmaker() as session:
        tenant = Tenant(name=f"t-{digest[:8]}", tier=tier, status=status, weight=2.0, tpm=77)
        session.add(tenant)
        await session.flush()
        key = await repo.add_api_key(
            session, tenant_id=tenant.id, digest=digest, prefix=prefix, **key_fields
        )
        await session.commit()
    return tenant, key, secret


def _count_queries(sessionmaker) -> list[str]:
    statements: list[str] = []
    engine = sessionmaker.kw["bind"].sync_engine
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    return statements


async def test_authenticate_resolves_principal(db_sessionmaker) -> None:
    tenant, key, secret = await _tenant_with_key(db_sessionmaker, tier="interactive")
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker))
    principal = await auth.authenticate(f"Bearer {secret}")
    assert principal.tenant_id == tenant.id
    assert principal.tenant_name == tenant.name
    assert principal.key_id == key.id
    assert principal.tier.name == "interactive"
    assert principal.weight == 2.0
    assert principal.tpm == 77  # the tenant's override
    assert principal.rpm == principal.tier.rpm == 300  # the tier's default
    assert principal.max_concurrency == principal.tier.max_concurrency
    # The scheme is case-insensitive, as in HTTP.
    assert (await auth.authenticate(f"bearer  {secret} ")).key_id == key.id


BAD_HEADERS = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Basic dXNlcjpwYXNz",
    "tg-" + "a" * 43,  # no scheme
    "Bearer sk-" + "a" * 43,  # another vendor's key
    "Bearer tg-short",
    "Bearer tg-" + "a" * 42 + "!",
    "Bearer tg-" + "a" * 5000,
    "Bearer tg-" + "a" * 43,  # well formed, unknown
]


async def test_bad_credentials_are_401(db_sessionmaker) -> None:
    await _tenant_with_key(db_sessionmaker)  # a real key exists; these are not it
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker))
    for header in BAD_HEADERS:
        with pytest.raises(AuthenticationError) as info:
            await auth.authenticate(header)
        assert info.value.code in ("missing_api_key", "invalid_api_key"), header


async def test_revoked_expired_and_suspended(db_sessionmaker) -> None:
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker))
    _, key, revoked = await _tenant_with_key(db_sessionmaker)
    async with db_sessionmaker() as session:
        await repo.revoke_api_key(session, key.id)
        await session.commit()
    with pytest.raises(AuthenticationError, match="revoked"):
        await auth.authenticate(f"Bearer {revoked}")

    past = datetime.now(UTC) - timedelta(seconds=1)
    _, _, expired = await _tenant_with_key(db_sessionmaker, expires_at=past)
    with pytest.raises(AuthenticationError, match="expired"):
        await auth.authenticate(f"Bearer {expired}")

    soon = datetime.now(UTC) + timedelta(milliseconds=300)
    _, _, expiring = await _tenant_with_key(db_sessionmaker, expires_at=soon)
    await auth.authenticate(f"Bearer {expiring}")  # valid now, and cached
    await asyncio.sleep(0.35)
    with pytest.raises(AuthenticationError, match="expired"):  # the cache does not extend it
        await auth.authenticate(f"Bearer {expiring}")

    _, _, suspended = await _tenant_with_key(db_sessionmaker, status="suspended")
    with pytest.raises(PermissionDeniedError) as info:
        await auth.authenticate(f"Bearer {suspended}")
    assert info.value.code == "tenant_suspended"


async def test_lookups_are_cached(db_sessionmaker) -> None:
    _, key, secret = await _tenant_with_key(db_sessionmaker)
    tiers = TierCatalog(db_sessionmaker, ttl_s=60)
    auth = KeyAuthenticator(db_sessionmaker, tiers, cache_ttl_s=60)
    await auth.authenticate(f"Bearer {secret}")
    unknown = "Bearer tg-" + "b" * 43
    with pytest.raises(AuthenticationError):
        await auth.authenticate(unknown)

    statements = _count_queries(db_sessionmaker)
    for _ in range(50):
        assert (await auth.authenticate(f"Bearer {secret}")).key_id == key.id
        with pytest.raises(AuthenticationError):
            await auth.authenticate(unknown)
    assert statements == []

    auth.invalidate_key(key.id)
    await auth.authenticate(f"Bearer {secret}")
    assert len(statements) == 1


async def test_a_burst_of_misses_shares_one_query(db_sessionmaker) -> None:
    # When a cached key expires under load, every request in flight misses at once.
    _, key, secret = await _tenant_with_key(db_sessionmaker)
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker, ttl_s=60))
    await auth._tiers.all()  # the tiers' own query is not what this counts
    statements = _count_queries(db_sessionmaker)
    principals = await asyncio.gather(
        *(auth.authenticate(f"Bearer {secret}") for _ in range(40)),
        *(auth.authenticate("Bearer tg-" + "c" * 43) for _ in range(10)),
        return_exceptions=True,
    )
    assert {p.key_id for p in principals[:40]} == {key.id}
    assert all(isinstance(p, AuthenticationError) for p in principals[40:])
    assert len(statements) == 2  # one per distinct key


async def test_a_waiter_that_leaves_does_not_cancel_the_shared_query(db_sessionmaker) -> None:
    _, key, secret = await _tenant_with_key(db_sessionmaker)
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker))
    leaving = asyncio.ensure_future(auth.authenticate(f"Bearer {secret}"))
    staying = asyncio.ensure_future(auth.authenticate(f"Bearer {secret}"))
    await asyncio.sleep(0)
    leaving.cancel()
    assert (await staying).key_id == key.id
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_a_revocation_during_a_load_is_not_missed(db_sessionmaker) -> None:
    # A load that began before the revocation may read the key as valid; a request
    # arriving after the revocation must not share it, and it must not be cached.
    _, key, secret = await _tenant_with_key(db_sessionmaker)
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker), cache_ttl_s=60)
    await auth._tiers.all()
    statements = _count_queries(db_sessionmaker)
    before = asyncio.ensure_future(auth.authenticate(f"Bearer {secret}"))
    await asyncio.sleep(0)  # its load is in flight
    auth.invalidate_key(key.id)
    after = asyncio.ensure_future(auth.authenticate(f"Bearer {secret}"))
    assert (await before).key_id == (await after).key_id == key.id
    assert len(statements) == 2  # the second request ran a load of its own
    async with db_sessionmaker() as session:
        await repo.revoke_api_key(session, key.id)
        await session.commit()
    auth.invalidate_key(key.id)
    with pytest.raises(AuthenticationError, match="revoked"):
        await auth.authenticate(f"Bearer {secret}")


async def test_other_processes_changes_arrive_within_ttl(db_sessionmaker) -> None:
    # A revocation made elsewhere (straight in the database, no invalidate call here)
    # takes effect once this process's cache entry expires.
    tenant, _, secret = await _tenant_with_key(db_sessionmaker)
    # Long enough that the update below lands well within it on a busy machine (at 0.2 s
    # a stalled commit outlived the entry).
    ttl_s = 2.0
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker), cache_ttl_s=ttl_s)
    await auth.authenticate(f"Bearer {secret}")
    async with db_sessionmaker() as session:
        await session.execute(
            update(Tenant).where(Tenant.id == tenant.id).values(status="suspended")
        )
        await session.commit()
    await auth.authenticate(f"Bearer {secret}")  # still cached
    await asyncio.sleep(ttl_s + 0.05)
    with pytest.raises(PermissionDeniedError):
        await auth.authenticate(f"Bearer {secret}")


async def test_invalidate_tenant_forgets_only_that_tenant(db_sessionmaker) -> None:
    tenant_a, _, secret_a = await _tenant_with_key(db_sessionmaker)
    _, _, secret_b = await _tenant_with_key(db_sessionmaker)
    auth = KeyAuthenticator(db_sessionmaker, TierCatalog(db_sessionmaker), cache_ttl_s=60)
    await auth.authenticate(f"Bearer {secret_a}")
    await auth.authenticate(f"Bearer {secret_b}")
    statements = _count_queries(db_sessionmaker)
    auth.invalidate_tenant(tenant_a.id)
    await auth.authenticate(f"Bearer {secret_b}")
    assert statements == []
    await auth.authenticate(f"Bearer {secret_a}")
    assert len(statements) == 1


async def test_no_key_is_stored_in_clear(db_sessionmaker) -> None:
    # Keys from both minting paths: a tenant's key and the demo tenants'.
    _, _, secret = await _tenant_with_key(db_sessionmaker, name="ci")
    secrets = [secret] + [d.api_key for d in await ensure_demo_tenants(db_sessionmaker)]

    async with db_sessionmaker() as session:
        conn = await session.connection()
        tables = await conn.run_sync(lambda c: inspect(c).get_table_names())
        dump = []
        for table in tables:
            rows = (await session.execute(text(f'SELECT * FROM "{table}"'))).all()
            dump += [str(value) for row in rows for value in row]
        digests = set((await session.scalars(select(ApiKey.digest))).all())
    everything = "\n".join(dump)
    for secret in secrets:
        # Not the key, nor any long piece of its random part.
        assert secret not in everything
        assert secret[10:30] not in everything
        assert hashlib.sha256(secret.encode()).hexdigest() in digests


async def test_a_tenant_moved_off_a_deleted_tier_is_read_again(db_sessionmaker) -> None:
    # Another process moved the tenant off its tier and deleted the tier: this process's
    # tiers are read again (its version poll), its key cache still has the old tier.
    async with db_sessionmaker() as session:
        session.add(Tier(name="doomed", rank=7))
        await session.commit()
    tenant, _, secret = await _tenant_with_key(db_sessionmaker, tier="doomed")
    tiers = TierCatalog(db_sessionmaker, ttl_s=60)
    auth = KeyAuthenticator(db_sessionmaker, tiers, cache_ttl_s=60)
    assert (await auth.authenticate(f"Bearer {secret}")).tier.name == "doomed"
    async with db_sessionmaker() as session:
        await session.execute(
            update(Tenant).where(Tenant.id == tenant.id).values(tier="interactive")
        )
        await session.execute(delete(Tier).where(Tier.name == "doomed"))
        await session.commit()
    tiers.invalidate()
    principal = await auth.authenticate(f"Bearer {secret}")
    assert (principal.tenant_id, principal.tier.name) == (tenant.id, "interactive")
