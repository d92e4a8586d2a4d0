"""Per-request usage records, buffered in memory and written to SQL in batches.

`record()` only appends to a buffer, so the request path never waits on the database;
a background task flushes every `flush_interval_s` (sooner once `max_batch` records are
waiting). If the database is unreachable the records stay buffered and are retried; past
`max_buffered` the oldest are dropped (and counted) rather than growing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import asdict, dataclass, replace
from datetime import datetime

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.db.models import UsageRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageRecord:
    """One request's outcome and cost drivers.

    outcome is "ok", "error", "aborted" (client went away) or "rejected:<code>" (refused
    at admission, e.g. "rejected:rate_limit_exceeded"). created_at is aware UTC.
    """

    request_id: str
    tenant_id: str
    tier: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    queue_wait_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    outcome: str
    created_at: datetime


_MAX_INT = 2**31 - 1


def _fit_columns(rec: UsageRecord) -> UsageRecord:
    """The record trimmed to what the columns hold, so that one odd record (an overlong
    model name) cannot make its batch fail forever and block every later one."""
    if not isinstance(rec, UsageRecord):
        raise TypeError(f"expected a UsageRecord, got {type(rec).__name__}")
    return replace(
        rec,
        request_id=rec.request_id[:64],
        tenant_id=rec.tenant_id[:40],
        tier=rec.tier[:32],
        model=rec.model[:200],
        outcome=rec.outcome[:64],
        prompt_tokens=min(max(int(rec.prompt_tokens), 0), _MAX_INT),
        completion_tokens=min(max(int(rec.completion_tokens), 0), _MAX_INT),
    )


class UsageWriter:
    """Buffers UsageRecords and writes them in batches off the request path."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker,
        *,
        flush_interval_s: float = 0.5,
        max_batch: int = 500,
        max_buffered: int = 100_000,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._buffer: deque[UsageRecord] = deque(maxlen=max_buffered)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._is_closing = False
        self._num_in_flight = 0
        self._num_failed_flushes = 0  # consecutive; logs the first in full, then a line
        self.num_written = 0
        self.num_dropped = 0

    @property
    def num_pending(self) -> int:
        """Records not yet written (buffered or being written)."""
        return len(self._buffer) + self._num_in_flight

    def record(self, rec: UsageRecord) -> None:
        """Queue one record. Never blocks and never raises."""
        try:
            rec = _fit_columns(rec)
            if len(self._buffer) == self._buffer.maxlen:
                self.num_dropped += 1  # the deque drops the oldest
            self._buffer.append(rec)
            if len(self._buffer) >= self._max_batch:
                self._wake.set()
        except Exception:  # accounting must never fail a request
            log.exception("usage record dropped")

    async def start(self) -> None:
        """Start the background flusher (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tiergate-usage-writer")

    async def aclose(self, *, timeout_s: float = 10.0) -> None:
        """Stop the flusher and write everything still buffered.

        The flusher is asked to stop rather than cancelled, so a batch being written is
        never cut off half way (and lost, or written twice).
        """
        task, self._task = self._task, None
        if task is not None:
            self._is_closing = True
            self._wake.set()
            try:
                await asyncio.wait_for(task, timeout_s)
            except TimeoutError:
                log.error("usage writer did not stop within %.1f s", timeout_s)
        while self._buffer:
            if not await self.flush():
                log.error("usage writer closed with %d records unwritten", len(self._buffer))
                break

    async def flush(self) -> bool:
        """Write up to one batch now; False if the database refused it (kept for retry)."""
        async with self._flush_lock:
            batch = [self._buffer.popleft() for _ in range(min(self._max_batch, len(self._buffer)))]
            if not batch:
                return True
            self._num_in_flight = len(batch)
            try:
                async with self._sessionmaker() as session, session.begin():
                    await session.execute(insert(UsageRow), [asdict(rec) for rec in batch])
            except Exception as exc:
                self._num_failed_flushes += 1
                if self._num_failed_flushes == 1:
                    log.exception("writing %d usage records failed; will retry", len(batch))
                else:
                    log.warning("usage records still unwritten (%s)", type(exc).__name__)
                # Back at the front, in order; the oldest fall off if the buffer is full.
                space = (self._buffer.maxlen or 0) - len(self._buffer)
                num_lost = max(0, len(batch) - space)
                self.num_dropped += num_lost
                self._buffer.extendleft(reversed(batch[num_lost:]))
                return False
            finally:
                self._num_in_flight = 0
            self._num_failed_flushes = 0
            self.num_written += len(batch)
            return True

    async def _run(self) -> None:
        while not self._is_closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_interval_s)
            self._wake.clear()
            while self._buffer and not self._is_closing:
                if not await self.flush():
                    break  # wait an interval before retrying a failing database
                if len(self._buffer) < self._max_batch:
                    break
