"""The queue policies we compare against, behind the interface the simulator drives.

`fcfs` serves in arrival order; `priority` serves the best rank first, arrival order
inside a rank (vLLM's priority mode); `vtc` is weighted fair share between all tenants,
with no tiers (the VTC paper). The tiered policy is the real one (see `fleet_queue`).

Every policy here is a `FleetQueue`: jobs are pushed at admission, popped by a worker
that can take work, and charged for the tokens the engine serves them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from scheduler.job import Job


class FleetQueue(Protocol):
    """The queue as the simulated fleet sees it (the calls a real worker makes, made
    synchronously on the virtual clock)."""

    def push(self, job: Job, now_s: float) -> None:
        """Queue an admitted job (may raise the backend's QueueFullError)."""

    def pop(self, now_s: float, worker_id: str) -> Job | None:
        """The next job for worker `worker_id`, which has room (its prompt tokens are
        charged), or None. Jobs queued past their max_queue_ms are dropped instead (see
        take_dropped)."""

    def charge(self, job: Job, num_output_tokens: int, now_s: float) -> None:
        """The engine generated tokens for this job (fair-share accounting)."""

    def complete(self, job: Job, now_s: float) -> None:
        """The job finished; the queue may forget it."""

    def take_dropped(self, now_s: float) -> list[str]:
        """Ids of jobs dropped with queue_timeout since the last call."""

    def __len__(self) -> int: ...

    def backlogged_tenants(self) -> set[str]:
        """Tenants with at least one queued job."""


def is_expired(job: Job, now_s: float) -> bool:
    """Queued past its max_queue_ms (the backend's rule, in the same milliseconds)."""
    return job.max_queue_ms is not None and now_s * 1000 >= job.arrival_s * 1000 + job.max_queue_ms


class _TenantCounts:
    """How many jobs each tenant has queued, for the fairness trace."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, tenant: str) -> None:
        self.counts[tenant] = self.counts.get(tenant, 0) + 1

    def remove(self, tenant: str) -> None:
        n = self.counts[tenant] - 1
        if n:
            self.counts[tenant] = n
        else:
            del self.counts[tenant]


class FcfsQueue:
    """First come, first served across everyone."""

    def __init__(self) -> None:
        self._heap: list[tuple[object, int, Job]] = []
        self._order = itertools.count()
        self._tenants = _TenantCounts()
        self._dropped: list[str] = []

    def _key(self, job: Job) -> object:
        return job.arrival_s

    def push(self, job: Job, now_s: float) -> None:
        heapq.heappush(self._heap, (self._key(job), next(self._order), job))
        self._tenants.add(job.tenant_id)

    def pop(self, now_s: float, worker_id: str) -> Job | None:
        while self._heap:
            job = heapq.heappop(self._heap)[2]
            self._tenants.remove(job.tenant_id)
            if not is_expired(job, now_s):
                return job
            self._dropped.append(job.job_id)
        return None

    def charge(self, job: Job, num_output_tokens: int, now_s: float) -> None:
        pass  # no account of service

    def complete(self, job: Job, now_s: float) -> None:
        pass

    def take_dropped(self, now_s: float) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def __len__(self) -> int:
        return len(self._heap)

    def backlogged_tenants(self) -> set[str]:
        return set(self._tenants.counts)


class PriorityQueue(FcfsQueue):
    """Strict rank order, arrival order inside a rank."""

    def _key(self, job: Job) -> object:
        return (job.rank, job.arrival_s)


class VtcQueue:
    """Virtual token counters between all tenants, ignoring tiers.

    The backlogged tenant with the smallest counter goes next; a tenant that becomes
    backlogged is lifted to the smallest backlogged counter (or to the counter last
    served), so idling banks no credit. Counters only grow, so the min-heap may hold
    stale (too small) keys: a popped stale key is re-pushed with the current counter.
    """

    def __init__(
        self, *, input_token_weight: float = 1.0, output_token_weight: float = 2.0
    ) -> None:
        self._input_weight = input_token_weight
        self._output_weight = output_token_weight
        self._queues: dict[str, deque[Job]] = {}
        self._counter: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (counter when pushed, tenant)
        self._floor = 0.0  # counter of the tenant served last
        self._num_jobs = 0
        self._dropped: list[str] = []

    def _min_backlogged(self) -> float | None:
        while self._heap:
            key, tenant = self._heap[0]
            if tenant not in self._queues:
                heapq.heappop(self._heap)  # drained since it was pushed
                continue
            current = self._counter[tenant]
            if key != current:
                heapq.heapreplace(self._heap, (current, tenant))
                continue
            return key
        return None

    def push(self, job: Job, now_s: float) -> None:
        tenant = job.tenant_id
        queue = self._queues.get(tenant)
        if queue is None:
            lowest = self._min_backlogged()
            own = self._counter.get(tenant, 0.0)
            self._counter[tenant] = max(own, self._floor if lowest is None else lowest)
            queue = self._queues[tenant] = deque()
            heapq.heappush(self._heap, (self._counter[tenant], tenant))
        queue.append(job)
        self._num_jobs += 1

    def pop(self, now_s: float, worker_id: str) -> Job | None:
        while self._min_backlogged() is not None:
            _, tenant = self._heap[0]
            queue = self._queues[tenant]
            job = queue.popleft()
            self._num_jobs -= 1
            if not queue:
                del self._queues[tenant]
                heapq.heappop(self._heap)
            if is_expired(job, now_s):
                self._dropped.append(job.job_id)
                continue
            self._floor = self._counter[tenant]
            # Prompt tokens are charged at dispatch, so a worker taking several jobs in a
            # row does not hand them all to the same tenant.
            self._add(job, self._input_weight * job.num_prompt_tokens)
            return job
        return None

    def _add(self, job: Job, cost: float) -> None:
        self._counter[job.tenant_id] = self._counter.get(job.tenant_id, 0.0) + cost / job.weight

    def charge(self, job: Job, num_output_tokens: int, now_s: float) -> None:
        self._add(job, self._output_weight * num_output_tokens)

    def complete(self, job: Job, now_s: float) -> None:
        pass

    def take_dropped(self, now_s: float) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def __len__(self) -> int:
        return self._num_jobs

    def backlogged_tenants(self) -> set[str]:
        return set(self._queues)
