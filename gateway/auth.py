"""API keys: minting, and authenticating a request's bearer key to a Principal.

A key is `tg-` plus 32 random bytes (urlsafe base64). Only its SHA-256 digest and a short
display prefix are stored. Lookups are cached for a few seconds so a request does not hit
the database; revoking or changing a tenant through the admin API invalidates the cache
of that process at once (other processes follow within `cache_ttl_s`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.db.models import ApiKey, Tenant
from gateway.errors import AuthenticationError, NotFoundError, PermissionDeniedError
from gateway.tiers import TierCatalog, TierPolicy

KEY_PREFIX = "tg-"
SECRET_NUM_BYTES = 32
DISPLAY_PREFIX_LEN = len(KEY_PREFIX) + 6
# 32 bytes are 43 urlsafe characters; longer is accepted (future keys), shorter is not.
_KEY_PATTERN = re.compile(r"tg-[A-Za-z0-9_-]{43,256}")


def digest_key(secret: str) -> str:
    """SHA-256 hex digest of a key: what the database holds instead of the key."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def generate_api_key() -> tuple[str, str, str]:
    """A fresh key: (secret `tg-...`, its SHA-256 hex digest, display prefix)."""
    secret = KEY_PREFIX + secrets.token_urlsafe(SECRET_NUM_BYTES)
    return secret, digest_key(secret), secret[:DISPLAY_PREFIX_LEN]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant behind a valid key, its tier and effective limits.

    rpm, tpm and max_concurrency are the tenant's override, else its tier's default;
    None means unlimited.
    """

    tenant_id: str
    tenant_name: str
    key_id: str
    tier: TierPolicy
    weight: float
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None


@dataclass(frozen=True)
class _KeyEntry:
    """A key row joined with its tenant, as cached."""

    key_id: str
    digest: str
    expires_at: datetime | None
    is_revoked: bool
    tenant_id: str
    tenant_name: str
    tenant_status: str
    tier_name: str
    weight: float
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None


def _parse_bearer(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationError(
            "Missing API key: send 'Authorization: Bearer tg-...'.", code="missing_api_key"
        )
    scheme, _, credentials = authorization.strip().partition(" ")
    secret = credentials.strip()
    is_bearer = scheme.lower() == "bearer"
    is_well_formed = _KEY_PATTERN.fullmatch(secret) is not None
    if is_bearer and secret.startswith(KEY_PREFIX) and not is_well_formed:
        # "expected 'Bearer tg-...'" read as a riddle for a key that starts so.
        raise AuthenticationError(
            "Malformed API key: a tiergate key is 'tg-' and 43 to 256 letters, digits, '_' or '-'.",
            code="invalid_api_key",
        )
    if not is_bearer or not is_well_formed:
        raise AuthenticationError(
            "Malformed API key: expected 'Authorization: Bearer tg-...'.",
            code="invalid_api_key",
        )
    return secret


class KeyAuthenticator:
    """Turns an Authorization header into a Principal, or raises.

    AuthenticationError (401) for a missing, malformed, unknown, revoked or expired key;
    PermissionDeniedError (403) for a suspended tenant. Unknown keys are cached too (as
    misses), so guessing keys does not turn into one query per attempt.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker,
        tiers: TierCatalog,
        *,
        cache_ttl_s: float = 5.0,
        max_cache_entries: int = 10_000,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._tiers = tiers
        self._cache_ttl_s = cache_ttl_s
        self._max_cache_entries = max_cache_entries
        # digest -> (entry or None for an unknown key, monotonic expiry); LRU order.
        self._cache: OrderedDict[str, tuple[_KeyEntry | None, float]] = OrderedDict()
        # Bumped by every invalidation: a lookup that started before one is not cached.
        self._generation = 0
        # digest -> (generation, load in flight). When an entry expires under load, every
        # request for that key misses at once; they share one query instead of each
        # taking a pooled connection (a herd of 32 made SQLite open 27 connections).
        self._loading: dict[str, tuple[int, asyncio.Task[_KeyEntry | None]]] = {}

    async def authenticate(self, authorization: str | None) -> Principal:
        """The Principal behind `authorization` (the raw header value)."""
        secret = _parse_bearer(authorization)
        digest = digest_key(secret)
        try:
            return await self._principal(digest, await self._lookup(digest))
        except NotFoundError:
            # The cached tenant's tier is gone: the tenant was moved off it and the tier
            # deleted, in another process, within this cache's lag. Its key is read
            # again, with the tenant's tier now; a tier still missing is a real 404.
            self._generation += 1
            self._cache.pop(digest, None)
            return await self._principal(digest, await self._lookup(digest))

    async def _principal(self, digest: str, entry: _KeyEntry | None) -> Principal:
        # The index lookup found the row by digest; the final check is constant-time.
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        if entry.is_revoked:
            raise AuthenticationError("This API key has been revoked.", code="invalid_api_key")
        if entry.expires_at is not None and entry.expires_at <= datetime.now(UTC):
            raise AuthenticationError("This API key has expired.", code="expired_api_key")
        if entry.tenant_status != "active":
            raise PermissionDeniedError(
                "This tenant is suspended; contact the administrator.", code="tenant_suspended"
            )
        tier = await self._tiers.get(entry.tier_name)
        return Principal(
            tenant_id=entry.tenant_id,
            tenant_name=entry.tenant_name,
            key_id=entry.key_id,
            tier=tier,
            weight=entry.weight,
            rpm=entry.rpm if entry.rpm is not None else tier.rpm,
            tpm=entry.tpm if entry.tpm is not None else tier.tpm,
            max_concurrency=(
                entry.max_concurrency if entry.max_concurrency is not None else tier.max_concurrency
            ),
        )

    def invalidate_key(self, key_id: str) -> None:
        """Forget a key (after revocation): its next use reads the database."""
        self._generation += 1
        for digest in [d for d, (e, _) in self._cache.items() if e and e.key_id == key_id]:
            del self._cache[digest]

    def invalidate_tenant(self, tenant_id: str) -> None:
        """Forget every key of a tenant (after a suspension, tier or limit change)."""
        self._generation += 1
        for digest in [d for d, (e, _) in self._cache.items() if e and e.tenant_id == tenant_id]:
            del self._cache[digest]

    def invalidate_all(self) -> None:
        """Forget everything."""
        self._generation += 1
        self._cache.clear()

    async def _lookup(self, digest: str) -> _KeyEntry | None:
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            self._cache.move_to_end(digest)
            return cached[0]
        generation = self._generation
        loading = self._loading.get(digest)
        # A load begun before an invalidation may hold what was just revoked: not shared.
        if loading is None or loading[0] != generation:
            loading = (generation, asyncio.ensure_future(self._load(digest)))
            self._loading[digest] = loading
            loading[1].add_done_callback(lambda task: self._loaded(digest, task, generation, now))
        # Shielded: a waiter that goes away (client disconnect) leaves the others' load.
        return await asyncio.shield(loading[1])

    def _loaded(
        self, digest: str, task: asyncio.Task[_KeyEntry | None], generation: int, started: float
    ) -> None:
        if self._loading.get(digest, (0, None))[1] is task:
            del self._loading[digest]
        if task.cancelled() or task.exception() is not None:
            return  # each waiter got the error; the next request tries again
        if generation == self._generation:
            self._cache[digest] = (task.result(), started + self._cache_ttl_s)
            self._cache.move_to_end(digest)
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)

    async def _load(self, digest: str) -> _KeyEntry | None:
        async with self._sessionmaker() as session:
            row = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .where(ApiKey.digest == digest)
                )
            ).first()
        if row is None:
            return None
        key, tenant = row
        return _KeyEntry(
            key_id=key.id,
            digest=key.digest,
            expires_at=key.expires_at,
            is_revoked=key.revoked_at is not None,
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            tenant_status=tenant.status,
            tier_name=tenant.tier,
            weight=tenant.weight,
            rpm=tenant.rpm,
            tpm=tenant.tpm,
            max_concurrency=tenant.max_concurrency,
        )
