"""Tier policies and a cached, in-process view of the tiers table.

A tier says how its tenants' requests are scheduled (rank, SLOs, queue TTL, batch
window, queue cap, guaranteed share, preemptibility), their default limits and their
prices. The built-in tiers and their defaults are documented in
migrations/versions/0002_seed_tiers.py (and the batch tier's queue cap in 0006).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.db.models import Tier
from gateway.errors import NotFoundError
from gateway.usage import TokenPrices


@dataclass(frozen=True)
class TierPolicy:
    """What a tier promises and charges. Limits are per tenant; None means unlimited."""

    name: str
    rank: int  # 0 is most important; lower ranks run first
    ttft_slo_ms: float | None  # None for throughput tiers
    tpot_slo_ms: float | None
    max_queue_ms: float | None  # time a request may wait queued before it is dropped
    max_queued_jobs: int | None  # queued jobs of all tenants together; more are refused
    completion_window_s: int | None  # batch deadline
    min_share: float  # share of token throughput kept even when better ranks are busy
    preemptible: bool
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    price_input_per_mtok: float
    price_output_per_mtok: float

    @classmethod
    def from_row(cls, row: Tier) -> TierPolicy:
        return cls(
            name=row.name,
            rank=row.rank,
            ttft_slo_ms=row.ttft_slo_ms,
            tpot_slo_ms=row.tpot_slo_ms,
            max_queue_ms=row.max_queue_ms,
            max_queued_jobs=row.max_queued_jobs,
            completion_window_s=row.completion_window_s,
            min_share=row.min_share,
            preemptible=row.preemptible,
            rpm=row.rpm,
            tpm=row.tpm,
            max_concurrency=row.max_concurrency,
            price_input_per_mtok=row.price_input_per_mtok,
            price_output_per_mtok=row.price_output_per_mtok,
        )

    @property
    def prices(self) -> TokenPrices:
        return TokenPrices(self.price_input_per_mtok, self.price_output_per_mtok)


# The least time between two reloads that a lookup of an unknown tier name may cause.
MISS_RELOAD_S = 0.1


class TierCatalog:
    """All tiers, read from SQL at most once per `ttl_s` (a request reads the cache).

    Admin changes made in this process call `invalidate()`, so they apply at once here;
    other processes see them within `ttl_s`.
    """

    def __init__(self, sessionmaker: async_sessionmaker, *, ttl_s: float = 1.0) -> None:
        self._sessionmaker = sessionmaker
        self._ttl_s = ttl_s
        self._tiers: dict[str, TierPolicy] = {}
        self._loaded_at: float | None = None
        self._lock = asyncio.Lock()
        # Bumped by invalidate(): a reload that started before an invalidation must not
        # mark its (possibly stale) result fresh.
        self._generation = 0

    def _is_fresh(self) -> bool:
        return self._loaded_at is not None and time.monotonic() - self._loaded_at < self._ttl_s

    async def _refresh(self) -> dict[str, TierPolicy]:
        if self._is_fresh():
            return self._tiers
        async with self._lock:
            # Another task may have reloaded while this one waited for the lock.
            if self._is_fresh():
                return self._tiers
            started, generation = time.monotonic(), self._generation
            async with self._sessionmaker() as session:
                rows = (await session.scalars(select(Tier))).all()
            self._tiers = {row.name: TierPolicy.from_row(row) for row in rows}
            if generation == self._generation:
                self._loaded_at = started
            return self._tiers

    async def get(self, name: str) -> TierPolicy:
        """The tier called `name`; NotFoundError if there is none."""
        tier = (await self._refresh()).get(name)
        if tier is None and self._may_reload_on_miss():
            # Created in another process since the cache was read (its tenant's key may
            # already be in use): read again rather than fail a valid request. At most
            # every MISS_RELOAD_S, so a flood of made-up names is not a flood of queries.
            self._forget()
            tier = (await self._refresh()).get(name)
        if tier is None:
            raise NotFoundError(f"Unknown tier {name!r}", param="tier", code="tier_not_found")
        return tier

    def _may_reload_on_miss(self) -> bool:
        loaded_at = self._loaded_at
        return loaded_at is None or time.monotonic() - loaded_at >= MISS_RELOAD_S

    async def all(self) -> list[TierPolicy]:
        """Every tier, best rank first (ties by name)."""
        return sorted((await self._refresh()).values(), key=lambda t: (t.rank, t.name))

    async def read_fresh(self) -> list[TierPolicy]:
        """Every tier as the database holds it now, best rank first."""
        self._forget()
        return await self.all()

    def invalidate(self) -> None:
        """Forget the cache; the next read goes to the database."""
        self._forget()

    def _forget(self) -> None:
        self._loaded_at = None
        self._generation += 1
