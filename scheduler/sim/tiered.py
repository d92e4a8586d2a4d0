"""The real tiered fair-share queue (the in-memory backend) on the simulator's clock.

The backend's operations are coroutines that never wait on anything but the result
streams, which the simulator does not read; `run_now` drives such a coroutine to its
end without an event loop, so the simulation stays a plain synchronous loop while
running exactly the code a `tiergate serve` process runs.
"""

from __future__ import annotations

import heapq
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from engine.step_scheduler import RankBacklog
from engine.stop_hazard import StopCurve
from scheduler.admission import NoCapacityError, check_slo
from scheduler.backend import JobStatus, SloUnattainableError
from scheduler.job import Job
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.slot_release import release_times_ms

T = TypeVar("T")

SLO_UNATTAINABLE = "slo_unattainable"
NO_CAPACITY = "no_capacity"

# Long enough that no lease expires inside a simulation: simulated workers never die.
_LEASE_MS = 10 * 24 * 3600 * 1000


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that completes without suspending; raise if it would suspend."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the queue backend suspended; the simulator cannot drive it")


class TieredQueue:
    """`FleetQueue` over the real MemoryBackend: tiers, min_share, deadline promotion,
    VTC between tenants, FIFO within a tenant, queue caps and queue timeouts."""

    def __init__(
        self,
        tiers: Sequence[TierConfig],
        clock: list[float],
        *,
        config: PolicyConfig | None = None,
    ) -> None:
        self._clock = clock
        # Finished jobs are forgotten quickly: nobody reads their result streams.
        self.backend = MemoryBackend(
            tiers,
            config=config,
            clock_ms=lambda: int(clock[0] * 1000),
            finished_ttl_ms=1,
        )
        self._tiers = {t.name: t for t in tiers}
        self._expiries: list[tuple[float, str]] = []
        self._queued: dict[str, Job] = {}
        self._backlog: dict[str, int] = {}

    def push(self, job: Job, now_s: float) -> None:
        run_now(self.backend.enqueue(job))
        self._queued[job.job_id] = job
        self._backlog[job.tenant_id] = self._backlog.get(job.tenant_id, 0) + 1
        if job.max_queue_ms is not None:
            heapq.heappush(self._expiries, (job.arrival_s + job.max_queue_ms / 1000, job.job_id))

    def _forget(self, job_id: str) -> Job | None:
        job = self._queued.pop(job_id, None)
        if job is not None:
            n = self._backlog[job.tenant_id] - 1
            if n:
                self._backlog[job.tenant_id] = n
            else:
                del self._backlog[job.tenant_id]
        return job

    def pop(self, now_s: float, worker_id: str) -> Job | None:
        job = run_now(self.backend.dispatch(worker_id, _LEASE_MS))
        if job is not None:
            self._forget(job.job_id)
        return job

    def charge(self, job: Job, num_output_tokens: int, now_s: float) -> None:
        run_now(self.backend.charge(job.job_id, output_tokens=num_output_tokens))

    def complete(self, job: Job, now_s: float) -> None:
        run_now(self.backend.complete(job.job_id, finish_reason="length"))

    def take_dropped(self, now_s: float) -> list[str]:
        """Jobs past their max_queue_ms that the backend dropped (it drops a bounded
        number per dispatch, so a job past its time may still be queued: it waits)."""
        dropped = []
        still_queued = []
        while self._expiries and self._expiries[0][0] <= now_s:
            expire_s, job_id = heapq.heappop(self._expiries)
            if job_id not in self._queued:
                continue
            status = run_now(self.backend.job_status(job_id))
            if status is JobStatus.QUEUED:
                still_queued.append((expire_s, job_id))
                continue
            self._forget(job_id)
            dropped.append(job_id)
        for item in still_queued:
            heapq.heappush(self._expiries, (item[0] + 1.0, item[1]))
        return dropped

    def __len__(self) -> int:
        return len(self._queued)

    def backlogged_tenants(self) -> set[str]:
        return set(self._backlog)

    def admit(self, job: Job) -> str | None:
        """The gateway's SLO admission (scheduler/admission.py) against this queue: None
        to admit, or the refusal code."""
        tier = self._tiers.get(job.tier)
        if tier is None:
            return None  # enqueue raises UnknownTierError
        try:
            run_now(check_slo(self.backend, job, tier))
        except SloUnattainableError:
            return SLO_UNATTAINABLE
        except NoCapacityError:
            return NO_CAPACITY
        return None

    def publish_capacity(
        self,
        worker_id: str,
        prefill_tokens_per_s: float,
        decode_tokens_per_s: float,
        ttl_ms: int,
        backlog: RankBacklog | None = None,
        num_free_seqs: int = 0,
        num_running: int = 0,
        stop_curve: StopCurve | None = None,
    ) -> None:
        """A simulated worker's measured rates, its engine's backlog per rank, the
        requests it would start at its next step and when its slots free, as its
        dispatcher publishes them."""
        backlog = backlog or RankBacklog()
        run_now(
            self.backend.publish_capacity(
                worker_id,
                prefill_tokens_per_s=prefill_tokens_per_s,
                decode_tokens_per_s=decode_tokens_per_s,
                ttl_ms=ttl_ms,
                unprefilled_tokens_by_rank=backlog.unprefilled_tokens_by_rank,
                decode_tokens_by_rank=backlog.decode_tokens_by_rank,
                num_free_seqs=num_free_seqs,
                release_ms=release_times_ms(
                    backlog.running_left, stop_curve, num_running, decode_tokens_per_s
                ),
                preemptible_by_rank=backlog.preemptible_by_rank,
                waiting_by_rank=backlog.waiting_by_rank,
            )
        )
