"""What the admin API needs from the composition root."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.auth import KeyAuthenticator
from gateway.tiers import TierCatalog
from scheduler.backend import QueueBackend


@dataclass(frozen=True)
class AdminDeps:
    """The database, the admin bearer token, the caches admin writes invalidate and the
    queue, which a tenant's weight change reaches at once (None: nothing to tell)."""

    sessionmaker: async_sessionmaker
    admin_token: str
    tiers: TierCatalog
    auth: KeyAuthenticator
    queue: QueueBackend | None = None
