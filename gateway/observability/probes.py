"""The small functions telemetry reads live state through, and the tier refresher.

Kept apart so that when the queue or the worker fleet changes shape (Redis queue,
several workers) only these functions change, not the metrics or the dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from gateway.observability.telemetry import QueueProbe, Telemetry, TierLike, WorkerProbe

log = logging.getLogger(__name__)


class _DepthAndTotals:
    """A queue probe that also carries the queue's totals (Telemetry reads `totals`)."""

    def __init__(
        self, by_tier: Callable[[], Mapping[str, int]], totals: Callable[[], Mapping[str, int]]
    ) -> None:
        self._by_tier = by_tier
        self.totals = totals

    def __call__(self) -> Mapping[str, int]:
        return self._by_tier()


def queue_depth_probe(queue: Any) -> QueueProbe:
    """Queued requests per tier, from whatever the queue exposes.

    A queue with `depth_by_tier()` answers per tier; one that only knows its length is
    reported under the tier "all". A queue with `totals()` (name -> count since the
    queue began) has them exported as counters too.
    """
    by_tier = getattr(queue, "depth_by_tier", None)
    if callable(by_tier):
        totals = getattr(queue, "totals", None)
        return _DepthAndTotals(by_tier, totals) if callable(totals) else by_tier

    def total() -> Mapping[str, int]:
        return {"all": len(queue)}

    return total


def local_worker_probe(engine: Any, worker_id: str) -> WorkerProbe:
    """The in-process engine as the one worker, through its `stats()` snapshot, under
    the id its dispatcher has in the queue (`/admin/v1/queues` lists it so)."""
    stats = getattr(engine, "stats", None)
    if not callable(stats):
        return dict

    def probe() -> Mapping[str, Any]:
        return {worker_id: stats()}

    return probe


async def keep_tiers_fresh(
    telemetry: Telemetry,
    load_tiers: Callable[[], Awaitable[Iterable[TierLike]]],
    *,
    interval_s: float = 1.0,
) -> None:
    """Copy the tiers' SLOs into telemetry every `interval_s` until cancelled.

    The tier catalog is a cache invalidated by admin writes, so an edited SLO applies
    to the attainment numbers within `interval_s`.
    """
    while True:
        try:
            telemetry.set_tiers(await load_tiers())
        except Exception as exc:  # the database may be down; keep the last known SLOs
            log.warning("could not refresh tier SLOs for telemetry (%s)", type(exc).__name__)
        await asyncio.sleep(interval_s)


async def stop_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
