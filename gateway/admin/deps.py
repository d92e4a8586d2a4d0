"""What the admin API needs from the composition root."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.auth import KeyAuthenticator
from gateway.tiers import TierCatalog


@dataclass(frozen=True)
class AdminDeps:
    """The database, the admin bearer token and the caches admin writes invalidate."""

    sessionmaker: async_sessionmaker
    admin_token: str
    tiers: TierCatalog
    auth: KeyAuthenticator
