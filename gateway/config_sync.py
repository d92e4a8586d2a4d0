"""Admin changes to tiers, tenants and keys reach every process within a second.

Each process caches tiers (TierCatalog) and keys (KeyAuthenticator). An admin write
invalidates the caches of the process that served it (the admin routes do that) and,
through the subclasses here, calls `ConfigSync.changed`: the tier table is pushed to the
queue (`configure_tiers`, which workers read at every dispatch) and a version counter in
Redis is bumped. Every gateway polls that counter every `poll_ms` and drops its caches
when it moves, so the next request reads the database.

With the in-memory queue there is one process: the local invalidation is all it takes,
plus the push to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from gateway.admission import tier_config
from gateway.auth import KeyAuthenticator
from gateway.tiers import TierCatalog
from scheduler.backend import QueueBackend

log = logging.getLogger(__name__)

CONFIG_VERSION_SUFFIX = "config_version"


class SyncedTierCatalog(TierCatalog):
    """A TierCatalog whose invalidation (an admin write) is announced to other processes."""

    def __init__(self, *args: Any, on_change: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_change = on_change

    def invalidate(self) -> None:
        super().invalidate()
        self._on_change()

    def invalidate_local(self) -> None:
        """Forget the cache without announcing it (another process changed the tiers)."""
        super().invalidate()


class SyncedKeyAuthenticator(KeyAuthenticator):
    """A KeyAuthenticator whose invalidations (admin writes) are announced to others."""

    def __init__(self, *args: Any, on_change: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_change = on_change

    def invalidate_key(self, key_id: str) -> None:
        super().invalidate_key(key_id)
        self._on_change()

    def invalidate_tenant(self, tenant_id: str) -> None:
        super().invalidate_tenant(tenant_id)
        self._on_change()


class ConfigSync:
    """Pushes tier changes to the queue and keeps every process's caches in step."""

    def __init__(
        self,
        backend: QueueBackend,
        *,
        redis_client: aioredis.Redis | None = None,
        version_key: str = "",
        poll_ms: int = 250,
    ) -> None:
        self._backend = backend
        self._redis = redis_client
        self._version_key = version_key
        self._poll_ms = poll_ms
        self._tiers: SyncedTierCatalog | None = None
        self._auth: SyncedKeyAuthenticator | None = None
        self._version: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def bind(self, tiers: SyncedTierCatalog, auth: SyncedKeyAuthenticator) -> None:
        self._tiers, self._auth = tiers, auth

    def changed(self) -> None:
        """An admin write happened here: tell the queue and the other processes."""
        task = asyncio.get_running_loop().create_task(self._announce())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def push_tiers(self) -> None:
        """Copy the tier table from SQL to the queue.

        Read afresh, not from this process's cache, which may lag another process's
        write by up to its TTL: a push from it would overwrite the newer table."""
        if self._tiers is None:
            return
        tiers = await self._tiers.read_fresh()
        await self._backend.configure_tiers([tier_config(t) for t in tiers])

    async def _announce(self) -> None:
        try:
            await self.push_tiers()
            if self._redis is not None:
                # The new version is not recorded as seen: other processes may have bumped
                # it since the last poll, and their changes would be skipped here. The
                # poller sees the move and drops the caches once more (harmless).
                await self._redis.incr(self._version_key)
        except Exception as exc:
            log.warning("could not announce a configuration change: %r", exc)

    async def start(self) -> None:
        """Push the tiers once, then (with Redis) follow other processes' changes."""
        await self.push_tiers()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                self._version = await self._redis.get(self._version_key)
            self._poller = asyncio.create_task(self._poll(), name="config-sync")

    async def _poll(self) -> None:
        assert self._redis is not None
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._poll_ms / 1000.0)
                return
            try:
                version = await self._redis.get(self._version_key)
            except Exception:
                continue  # Redis is down: requests get 503 anyway; try again
            if version != self._version:
                self._version = version
                if self._tiers is not None:
                    self._tiers.invalidate_local()
                if self._auth is not None:
                    KeyAuthenticator.invalidate_all(self._auth)
                # Pushes from two processes can land out of order (each read SQL, then
                # wrote the queue); every process pushing again after the last bump,
                # which follows the last commit, leaves the queue with what SQL holds.
                with contextlib.suppress(Exception):
                    await self.push_tiers()

    async def aclose(self) -> None:
        # Stopped between polls, not cancelled: a cancel in the middle of its database
        # read could leave a pooled connection that the engine's disposal waits on.
        self._stopping.set()
        if self._poller is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._poller), 5.0)
            except TimeoutError:
                self._poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
