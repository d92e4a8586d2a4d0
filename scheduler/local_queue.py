"""The single-process queue: jobs ordered by tier rank, then arrival.

This is the simple ordering of the embedded `tiergate serve`; the fair-share queue
(weighted between tenants, Redis-backed) replaces it without changing the interface the
dispatcher uses: push, pop, remove, wait_nonempty.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter

from scheduler.job import Job


class LocalQueue:
    """A priority queue of jobs: lower rank first, then earlier arrival, then push order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Job]] = []
        self._queued: dict[str, Job] = {}  # job_id -> job, for O(1) remove
        self._order = itertools.count()
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._queued

    def push(self, job: Job) -> None:
        if job.job_id in self._queued:
            raise ValueError(f"job {job.job_id} is already queued")
        self._queued[job.job_id] = job
        heapq.heappush(self._heap, (job.rank, job.arrival_s, next(self._order), job))
        self._nonempty.set()

    def pop(self) -> Job | None:
        """The next job to run, or None when the queue is empty."""
        while self._heap:
            *_, job = heapq.heappop(self._heap)
            # Removed jobs stay in the heap until they surface (lazy deletion).
            if self._queued.pop(job.job_id, None) is job:
                self._sync_event()
                return job
        self._sync_event()
        return None

    def remove(self, job_id: str) -> bool:
        """Drop a queued job (its client went away); False if it is not queued."""
        found = self._queued.pop(job_id, None) is not None
        self._sync_event()
        return found

    async def wait_nonempty(self) -> None:
        await self._nonempty.wait()

    def depth_by_tier(self) -> dict[str, int]:
        return dict(Counter(job.tier for job in self._queued.values()))

    def _sync_event(self) -> None:
        if self._queued:
            self._nonempty.set()
        else:
            self._nonempty.clear()
            self._heap.clear()  # only removed (stale) entries can be left
