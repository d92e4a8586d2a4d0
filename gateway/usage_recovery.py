"""Billing the requests of a gateway that died before it billed them.

A gateway writes each request's usage record when the request ends, off the request
path (gateway.usage.UsageWriter), then settles the request's jobs in the queue. One that
dies (a SIGKILL, a lost host) leaves served work unbilled: its streams in flight, and
the records still in its buffer. So every gateway of a Redis fleet runs a UsageRecovery:
every few seconds it claims such jobs from the queue (QueueBackend.claim_unbilled: their
gateway has been gone for BILL_GRACE_MS and they have ended) and writes one record per
request for what the queue saw served, unless a record of that request is in the
database after all (its gateway was cut off from Redis rather than dead, or died
between writing its records and settling them).

The record is the queue's view: the tokens in the jobs' result streams, the prompt once
a job's first step came back (as the gateway bills a request that left the queue), the
times of the streams' events, and an outcome from how the jobs ended (`ok` when every
one finished, `error` when one failed, else `aborted`). It is judged and priced by its
tier's SLO and prices at the write. A claimed job is this gateway's to bill: should it
die before the record is written, that request goes unbilled (two failures in a row).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.db.models import UsageRow
from gateway.openai.choices import choice_counts, request_of_job
from gateway.usage import UsageRecord, UsageWriter
from scheduler.backend import BackendUnavailableError, JobStatus, QueueBackend, UnbilledJob

log = logging.getLogger(__name__)

RECOVER_EVERY_S = 5.0
MAX_CLAIM = 200  # jobs per claim: one script call, and one database query per round
# A record of the request may be this much older than the queue's events say (clocks).
_CLOCK_SLACK = timedelta(hours=1)


def recovered_record(request_id: str, jobs: Sequence[UnbilledJob], model: str) -> UsageRecord:
    """The usage record of one request from its claimed jobs."""
    served = [j for j in jobs if j.queue_wait_ms is not None]
    arrivals = [j.arrival_ms for j in served if j.arrival_ms is not None]
    arrival_ms = min(arrivals, default=None)
    firsts = [j.first_token_ms for j in jobs if j.first_token_ms is not None]
    ends = [j.ended_ms for j in jobs if j.ended_ms is not None]
    ended_ms = max(ends, default=None)
    statuses = {j.status for j in jobs}
    if statuses == {JobStatus.DONE}:
        outcome = "ok"
    elif JobStatus.FAILED in statuses:
        outcome = "error"
    else:
        outcome = "aborted"
    return UsageRecord(
        request_id=request_id,
        tenant_id=jobs[0].tenant_id,
        tier=jobs[0].tier,
        model=model,
        prompt_tokens=sum(j.prompt_tokens for j in jobs) if served else 0,
        queue_wait_ms=min((j.queue_wait_ms for j in served), default=None),  # type: ignore[type-var]
        ttft_ms=None if arrival_ms is None or not firsts else float(min(firsts) - arrival_ms),
        e2e_ms=0.0 if arrival_ms is None or ended_ms is None else float(ended_ms - arrival_ms),
        outcome=outcome,
        created_at=datetime.now(UTC)
        if ended_ms is None
        else datetime.fromtimestamp(ended_ms / 1000.0, UTC),
        **choice_counts([j.output_tokens for j in jobs]),
    )


class UsageRecovery:
    """Claims the unbilled jobs of gone gateways and bills them through `usage`."""

    def __init__(
        self,
        backend: QueueBackend,
        gateway_id: str,
        usage: UsageWriter,
        sessionmaker: async_sessionmaker,
        *,
        model: str,
        every_s: float = RECOVER_EVERY_S,
    ) -> None:
        self._backend = backend
        self._gateway_id = gateway_id
        self._usage = usage
        self._sessionmaker = sessionmaker
        self._model = model
        self._every_s = every_s
        # Claimed requests whose records are not handed to the writer yet (the database
        # could not say whether they were written): tried again next round.
        self._claimed: dict[str, list[UnbilledJob]] = {}
        self._task: asyncio.Task[None] | None = None
        self.num_recovered = 0  # records written for gone gateways' requests

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-recovery")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._claimed:
            log.error("%d claimed requests of gone gateways left unbilled", len(self._claimed))

    async def _run(self) -> None:
        while True:
            try:
                while await self.run_once() >= MAX_CLAIM:
                    pass  # more may be waiting: claim again at once
            except BackendUnavailableError as exc:
                log.debug("usage recovery: %s", exc)
            except Exception:
                log.exception("usage recovery failed")
            await asyncio.sleep(self._every_s)

    async def run_once(self) -> int:
        """One round: claim, then bill what no record covers. Returns the jobs claimed."""
        jobs = await self._backend.claim_unbilled(self._gateway_id, MAX_CLAIM)
        for job in jobs:
            self._claimed.setdefault(request_of_job(job.job_id), []).append(job)
        if self._claimed:
            await self._bill_claimed()
        return len(jobs)

    async def _bill_claimed(self) -> None:
        claimed = self._claimed
        written = await self._written(claimed)  # raises: kept for the next round
        self._claimed = {}
        for request_id, jobs in claimed.items():
            if request_id not in written:
                self._usage.record(recovered_record(request_id, jobs, self._model))
                self.num_recovered += 1
        if len(claimed) > len(written):
            log.info(
                "billed %d requests of gateways that went away (%d had their records)",
                len(claimed) - len(written),
                len(written),
            )

    async def _written(self, claimed: dict[str, list[UnbilledJob]]) -> set[str]:
        """The request ids among `claimed` that already have a usage record."""
        jobs = [j for js in claimed.values() for j in js]
        arrivals = [j.arrival_ms for j in jobs if j.arrival_ms is not None]
        since = (
            datetime.fromtimestamp(min(arrivals) / 1000.0, UTC)
            if arrivals
            else datetime.now(UTC) - timedelta(hours=1)
        ) - _CLOCK_SLACK
        query = select(UsageRow.request_id).where(
            UsageRow.tenant_id.in_({j.tenant_id for j in jobs}),
            UsageRow.created_at >= since,
            UsageRow.request_id.in_(list(claimed)),
        )
        async with self._sessionmaker() as session:
            return set((await session.execute(query)).scalars())
