"""The single-process queue backend: the policy over heaps, results over asyncio.

Semantics are those of the Redis backend (scheduler/lua/*.lua), operation for operation,
including tie-breaks: a Redis sorted set orders by (score, member), and every heap here
orders by the same pair. Removals are lazy: stale heap entries are skipped when they
surface, which keeps every operation O(log n).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler import policy
from scheduler.backend import (
    QUEUE_TIMEOUT,
    START_CURSOR,
    DuplicateJobError,
    EventKind,
    FleetCapacity,
    JobProgress,
    JobStatus,
    QueueFullError,
    QueueTotals,
    ResultEvent,
    SloBudget,
    TenantDepth,
    TierDepth,
    UnbilledJob,
    UnknownTierError,
    WorkAhead,
    WorkerReport,
    add_by_rank,
    best_rank_waiting,
    worker_details,
)
from scheduler.job import Job
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.slot_release import merge_releases


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class _Entry:
    job: Job
    seq: int
    status: JobStatus = JobStatus.QUEUED
    worker_id: str = ""
    lease_until_ms: int = 0
    num_leases: int = 0
    is_input_charged: bool = False
    resumed_token_ids: tuple[int, ...] = ()
    expire_at_ms: int | None = None
    deadline_ms: int | None = None
    took_free_seq: bool = False  # its lease took a slot its worker reported free


@dataclass(eq=False)
class _TenantQueue:
    heap: list[tuple[int, str]] = field(default_factory=list)  # (seq, job_id)
    members: set[str] = field(default_factory=set)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def head(self) -> str | None:
        while self.heap and self.heap[0][1] not in self.members:
            heapq.heappop(self.heap)
        return self.heap[0][1] if self.heap else None


@dataclass(eq=False)
class _Window:
    """Tokens served per fixed bucket, with the sum over the sliding window kept for the
    current bucket: dispatch asks for it every time, and recounting the buckets (and
    pruning those that left the window) is needed only when the bucket moves on."""

    num_buckets: int
    buckets: dict[int, int] = field(default_factory=dict)  # bucket -> tokens served
    sum_bucket: int | None = None  # the current bucket `sum_tokens` was counted for
    sum_tokens: int = 0

    def add(self, bucket: int, tokens: int) -> None:
        if bucket not in self.buckets and len(self.buckets) >= self.num_buckets:
            # A new bucket: forget those that left the window (whether or not anyone asks
            # for the sum), so the table stays num_buckets long.
            oldest = bucket - self.num_buckets
            for old in [b for b in self.buckets if b <= oldest]:
                del self.buckets[old]
            self.sum_bucket = None
        self.buckets[bucket] = self.buckets.get(bucket, 0) + tokens
        if self.sum_bucket is not None and bucket > self.sum_bucket - self.num_buckets:
            self.sum_tokens += tokens

    def sum(self, current_bucket: int) -> int:
        """policy.window_sum for `current_bucket`."""
        if self.sum_bucket != current_bucket:
            oldest = current_bucket - self.num_buckets
            for bucket in [b for b in self.buckets if b <= oldest]:
                del self.buckets[bucket]
            self.sum_bucket = current_bucket
            self.sum_tokens = sum(self.buckets.values())
        return self.sum_tokens


@dataclass(eq=False)
class _Tier:
    share: _Window  # tokens served to the tier
    queues: dict[str, _TenantQueue] = field(default_factory=dict)
    active: dict[str, float] = field(default_factory=dict)  # backlogged tenant -> counter
    active_heap: list[tuple[float, str]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    floor: float = 0.0
    num_jobs: int = 0

    def min_active(self) -> tuple[float, str] | None:
        heap = self.active_heap
        while heap and self.active.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def set_active(self, tenant: str, counter: float) -> None:
        self.active[tenant] = counter
        heapq.heappush(self.active_heap, (counter, tenant))


@dataclass(eq=False)
class _Stream:
    clock_ms: Callable[[], int]
    events: list[ResultEvent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Its tokens, and when the first and the last came (job_progress).
    num_tokens: int = 0
    first_token_ms: int | None = None
    last_token_ms: int | None = None
    # Its current run (JobProgress.run_first_token_ms): when the event that began it
    # came, and the tokens streamed before; None for the job's first run. A lease's
    # first event (with the queue wait) for a job that streamed tokens begins one, as
    # in publish_step.lua.
    run_first_ms: int | None = None
    run_base_tokens: int = 0

    def append(self, kind: EventKind, **fields: Any) -> None:
        self.events.append(ResultEvent(kind, cursor=str(len(self.events) + 1), **fields))
        if fields.get("queue_wait_ms") is not None and self.num_tokens:
            self.run_first_ms = self.clock_ms()
            self.run_base_tokens = self.num_tokens
        if num_tokens := len(fields.get("token_ids", ())):
            self.num_tokens += num_tokens
            self.last_token_ms = self.clock_ms()
            if self.first_token_ms is None:
                self.first_token_ms = self.last_token_ms
        self.changed.set()
        if kind is EventKind.TOKENS:  # after the last event nobody waits for another
            self.changed = asyncio.Event()


class MemoryBackend:
    """In-process queue for `tiergate serve` (one process); see QueueBackend."""

    def __init__(
        self,
        tiers: Sequence[TierConfig] = (),
        *,
        config: PolicyConfig | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        finished_ttl_ms: int = 3_600_000,
        finished_result_ttl_ms: int = 60_000,
    ) -> None:
        self._config = config or PolicyConfig()
        self._clock_ms = clock_ms
        self._finished_ttl_ms = finished_ttl_ms
        # A finished job's result stream is kept this long, for a reader that comes back,
        # then goes: its one reader is in this process and read it as it was written,
        # and kept as long as the job's entry, streams held gigabytes at a few hundred
        # requests a second.
        self._finished_result_ttl_ms = min(finished_result_ttl_ms, finished_ttl_ms)
        self._tier_configs: dict[str, TierConfig] = {}
        self._tiers: dict[str, _Tier] = {}
        self._entries: dict[str, _Entry] = {}  # queued and leased jobs
        # Finished jobs, kept finished_ttl_ms for job_status, duplicate ids, late charges
        # and job_progress: (status, tier, tenant, weight, max_tokens), plain strings and
        # numbers. At a few hundred requests a second an hour of them is a million
        # entries: as tuples of atomic values the garbage collector stops tracking them,
        # while the queue's entries (three objects a job) made every full collection walk
        # them all.
        self._finished: dict[str, tuple[str, str, str, float, int]] = {}
        self._streams: dict[str, _Stream] = {}
        # Each tenant's current weight, which every charge divides by, and its queued and
        # leased jobs: the weight goes with the last of them (the `weights` and
        # `live_jobs` hashes of the Redis backend).
        self._weights: dict[str, float] = {}
        self._num_live_jobs: dict[str, int] = {}
        self._seq = 0
        self._expiries: list[tuple[int, str]] = []
        self._deadlines: list[tuple[int, str]] = []
        self._leases: list[tuple[int, str]] = []
        self._purges: list[tuple[int, str]] = []
        self._result_purges: list[tuple[int, str]] = []
        self._bucket_ms = self._config.share_bucket_ms
        self._total_share = _Window(self._config.share_buckets)
        # Every known tier best first (rank, name), with its min_share: dispatch walks it
        # instead of sorting. Rebuilt when the tier table changes or a tier appears.
        self._order: list[tuple[float, _Tier]] = []
        self._workers: dict[str, tuple[int, FleetCapacity]] = {}  # until ms, one report
        # Per worker, the jobs leased into its free slots since its last report and
        # running: job id -> (rank, max_tokens), held work its report does not show yet.
        self._seated: dict[str, dict[str, tuple[int, int]]] = {}
        # Admission reads the fleet's sum per request, workers change it per heartbeat:
        # the sum is kept until a report arrives or lapses (none lapses before this).
        self._fleet: FleetCapacity | None = None
        self._next_lapse_ms: float = math.inf
        # What worker_reports shows of each report: published at ms, operator fields.
        # worker id -> (published at ms, WorkerReport fields shown to operators)
        self._worker_details: dict[str, tuple[int, dict[str, Any]]] = {}
        self._num_lease_expirations = 0
        self._num_requeues = 0
        self._configure(tiers)

    # -- tiers -------------------------------------------------------------------------

    def _configure(self, tiers: Sequence[TierConfig]) -> None:
        policy.validate_tiers(tiers)
        self._tier_configs = {t.name: t for t in tiers}
        # A tier no longer configured and with nothing queued is forgotten (its counters
        # and share window): tiers an admin churns through must not pile up, and one
        # made again under the same name starts afresh. Jobs of it still running charge
        # a new, empty state.
        for name in [n for n, t in self._tiers.items() if n not in self._tier_configs]:
            if self._tiers[name].num_jobs == 0:
                del self._tiers[name]
        self._reorder()

    def _reorder(self) -> None:
        keyed = []
        for name, tier in self._tiers.items():
            config = self._tier_configs.get(name)
            min_share = 0.0 if config is None else config.min_share
            keyed.append(((self._rank(name), name), min_share, tier))
        keyed.sort(key=lambda k: k[0])
        self._order = [(min_share, tier) for _, min_share, tier in keyed]

    async def configure_tiers(self, tiers: Sequence[TierConfig]) -> None:
        self._configure(tiers)

    async def get_tiers(self) -> list[TierConfig]:
        return policy.tier_order(list(self._tier_configs.values()))

    def _rank(self, tier: str) -> int:
        config = self._tier_configs.get(tier)
        return policy.UNCONFIGURED_TIER_RANK if config is None else config.rank

    def _tier(self, name: str) -> _Tier:
        tier = self._tiers.get(name)
        if tier is None:
            tier = self._tiers[name] = _Tier(_Window(self._config.share_buckets))
            self._reorder()
        return tier

    # -- queue -------------------------------------------------------------------------

    async def enqueue(
        self, job: Job, *, slo: SloBudget | None = None, gateway_id: str | None = None
    ) -> float | None:
        # `gateway_id` is not kept: this queue lives in its gateway's process, so no job
        # can outlive the gateway that queued it (no job is ever abandoned here).
        self._purge(self._clock_ms())
        config = self._tier_configs.get(job.tier)
        if config is None:
            raise UnknownTierError(job.tier)
        predicted = None
        if slo is not None:
            work = self._work_ahead(job.tier, job.tenant_id, job.weight, job.num_prompt_tokens)
            predicted = slo.predict_ms(work, job.num_prompt_tokens, self._held_now(config.rank))
            refusal = slo.refusal(job.tier, predicted, job.num_prompt_tokens)
            if refusal is not None:
                raise refusal
        if job.job_id in self._entries or job.job_id in self._finished:
            raise DuplicateJobError(job.job_id)
        tier = self._tier(job.tier)
        if config.max_queued_jobs is not None and tier.num_jobs >= config.max_queued_jobs:
            raise QueueFullError(job.tier, config.max_queued_jobs)
        self._seq += 1
        # Stored as dispatch returns it (the tier's rank), so that dispatch copies the job
        # only when the rank changed or the job resumes.
        rank = self._rank(job.tier)
        entry = _Entry(
            job if job.rank == rank else replace(job, rank=rank),
            self._seq,
            expire_at_ms=policy.expire_at_ms(job),
            deadline_ms=policy.deadline_ms(job),
        )
        self._entries[job.job_id] = entry
        # The job's weight is the latest the gateway knew: the tenant's from now on.
        self._weights[job.tenant_id] = job.weight
        self._num_live_jobs[job.tenant_id] = self._num_live_jobs.get(job.tenant_id, 0) + 1
        self._push(entry)
        if entry.expire_at_ms is not None:
            heapq.heappush(self._expiries, (entry.expire_at_ms, job.job_id))
        return predicted

    def _push(self, entry: _Entry) -> None:
        job = entry.job
        tier = self._tier(job.tier)
        queue = tier.queues.get(job.tenant_id)
        if queue is None:
            queue = tier.queues[job.tenant_id] = _TenantQueue()
        queue.members.add(job.job_id)
        heapq.heappush(queue.heap, (entry.seq, job.job_id))
        queue.num_prefill_tokens += job.num_prompt_tokens
        queue.num_decode_tokens += job.params.max_tokens
        tier.num_jobs += 1
        entry.status = JobStatus.QUEUED
        if entry.deadline_ms is not None:
            heapq.heappush(self._deadlines, (entry.deadline_ms, job.job_id))
        if job.tenant_id not in tier.active:
            low = tier.min_active()
            own = tier.counters.get(job.tenant_id, 0.0)
            lifted = policy.lifted_counter(own, None if low is None else low[0], tier.floor)
            tier.counters[job.tenant_id] = lifted
            tier.set_active(job.tenant_id, lifted)

    def _unqueue(self, entry: _Entry) -> None:
        job = entry.job
        tier = self._tiers[job.tier]
        queue = tier.queues[job.tenant_id]
        queue.members.discard(job.job_id)
        queue.num_prefill_tokens -= job.num_prompt_tokens
        queue.num_decode_tokens -= job.params.max_tokens
        tier.num_jobs -= 1
        if not queue.members:
            del tier.queues[job.tenant_id]
            del tier.active[job.tenant_id]

    async def dispatch_many(self, worker_id: str, lease_ms: int, num_jobs: int) -> list[Job]:
        jobs = []
        for _ in range(num_jobs):
            job = await self.dispatch(worker_id, lease_ms)
            if job is None:
                break
            jobs.append(job)
        return jobs

    async def dispatch(self, worker_id: str, lease_ms: int) -> Job | None:
        now_ms = self._clock_ms()
        self._purge(now_ms)
        self._drop_expired(now_ms)
        job_id = self._promoted(now_ms) or self._pick(now_ms)
        if job_id is None:
            return None
        entry = self._entries[job_id]
        job = entry.job
        tier = self._tiers[job.tier]
        self._unqueue(entry)
        counter = tier.counters[job.tenant_id]
        tier.floor = counter
        if not entry.is_input_charged:
            entry.is_input_charged = True
            self._charge(job.tier, job.tenant_id, job.weight, job.num_prompt_tokens, 0, now_ms)
        entry.status = JobStatus.LEASED
        entry.worker_id = worker_id
        entry.lease_until_ms = now_ms + lease_ms
        entry.num_leases += 1
        heapq.heappush(self._leases, (entry.lease_until_ms, job_id))
        rank = self._rank(job.tier)
        entry.took_free_seq = self._take_free_seq(worker_id)
        if entry.took_free_seq:
            self._seated.setdefault(worker_id, {})[job_id] = (rank, job.params.max_tokens)
        if job.rank != rank or job.resumed_token_ids != entry.resumed_token_ids:
            job = entry.job = replace(job, rank=rank, resumed_token_ids=entry.resumed_token_ids)
        return job

    def _drop_expired(self, now_ms: int) -> None:
        num_dropped = 0
        heap = self._expiries
        while heap and heap[0][0] <= now_ms and num_dropped < self._config.max_expired_per_dispatch:
            expire_ms, job_id = heapq.heappop(heap)
            entry = self._entries.get(job_id)
            if (
                entry is None
                or entry.status is not JobStatus.QUEUED
                or entry.expire_at_ms != expire_ms
            ):
                continue
            num_dropped += 1
            self._unqueue(entry)
            self._stream(job_id).append(
                EventKind.ERROR, code=QUEUE_TIMEOUT, message="queued longer than max_queue_ms"
            )
            self._finish(entry, JobStatus.DROPPED, now_ms)

    def _promoted(self, now_ms: int) -> str | None:
        heap = self._deadlines
        while heap:
            deadline, job_id = heap[0]
            entry = self._entries.get(job_id)
            if (
                entry is None
                or entry.status is not JobStatus.QUEUED
                or entry.deadline_ms != deadline
            ):
                heapq.heappop(heap)
                continue
            return job_id if policy.is_deadline_at_risk(deadline, now_ms, self._config) else None
        return None

    def _pick(self, now_ms: int) -> str | None:
        # policy.choose_tier over the backlogged tiers, without building them a list: the
        # first backlogged tier in (rank, name) order, unless a tier is below its
        # min_share, the first such in that order. Window sums are read only when needed.
        current = now_ms // self._bucket_ms
        best = None
        total = None
        for min_share, tier in self._order:
            if not tier.num_jobs:
                continue
            if best is None:
                best = tier
            if min_share > 0:
                if total is None:
                    total = self._total_share.sum(current)
                if total > 0 and tier.share.sum(current) < min_share * total:
                    best = tier
                    break
        if best is None:
            return None
        low = best.min_active()
        assert low is not None  # a tier with queued jobs has a backlogged tenant
        return best.queues[low[1]].head()

    def _charge(
        self,
        tier_name: str,
        tenant_id: str,
        job_weight: float,
        input_tokens: int,
        output_tokens: int,
        now_ms: int,
    ) -> None:
        tier = self._tier(tier_name)
        # At the tenant's current weight, so that a change applies to work already queued
        # or running; the job's own only for tokens reported after the tenant's last job
        # finished. The counter is never rescaled (see set_tenant_weight).
        weight = self._weights.get(tenant_id, job_weight)
        cost = policy.charge_cost(input_tokens, output_tokens, weight, self._config)
        counter = tier.counters.get(tenant_id, 0.0) + cost
        tier.counters[tenant_id] = counter
        if tenant_id in tier.active:
            tier.set_active(tenant_id, counter)
        bucket = now_ms // self._bucket_ms  # policy.share_bucket
        tokens = input_tokens + output_tokens
        tier.share.add(bucket, tokens)
        self._total_share.add(bucket, tokens)

    async def charge(self, job_id: str, *, input_tokens: int = 0, output_tokens: int = 0) -> bool:
        entry = self._entries.get(job_id)
        if entry is not None:
            job = entry.job
            tier_name, tenant_id, weight = job.tier, job.tenant_id, job.weight
        elif job_id in self._finished:  # a late charge of a finished job still counts
            _, tier_name, tenant_id, weight, _ = self._finished[job_id]
        else:
            return False
        self._charge(tier_name, tenant_id, weight, input_tokens, output_tokens, self._clock_ms())
        return True

    async def set_tenant_weight(self, tenant_id: str, weight: float) -> bool:
        policy.validate_weight(weight)
        if tenant_id not in self._num_live_jobs:
            return False  # nothing to apply it to; the tenant's next job brings it
        # Only later charges use it: counters keep their units (tokens per unit of
        # weight), so comparing them and lifting a returning tenant stay fair.
        self._weights[tenant_id] = float(weight)
        return True

    async def tenant_weight(self, tenant_id: str) -> float | None:
        return self._weights.get(tenant_id)

    async def renew(self, worker_id: str, job_id: str, lease_ms: int) -> bool:
        entry = self._entries.get(job_id)
        if entry is None or entry.status is not JobStatus.LEASED or entry.worker_id != worker_id:
            return False
        entry.lease_until_ms = self._clock_ms() + lease_ms
        heapq.heappush(self._leases, (entry.lease_until_ms, job_id))
        return True

    def _requeue(self, entry: _Entry, resumed_token_ids: tuple[int, ...]) -> None:
        self._give_back_seq(entry)
        entry.resumed_token_ids = resumed_token_ids
        entry.worker_id = ""
        entry.lease_until_ms = 0
        # Admitted work that already ran is never dropped for having queued too long.
        entry.expire_at_ms = None
        self._push(entry)

    async def requeue(self, job_id: str, *, worker_id: str | None = None) -> bool:
        entry = self._entries.get(job_id)
        if entry is None or entry.status is not JobStatus.LEASED:
            return False
        if worker_id is not None and entry.worker_id != worker_id:
            return False
        self._requeue(entry, self._streamed(job_id))
        self._num_requeues += 1
        return True

    async def reclaim_expired_leases(self, now_ms: int | None = None) -> list[str]:
        now_ms = self._clock_ms() if now_ms is None else now_ms
        reclaimed = []
        heap = self._leases
        while (
            heap and heap[0][0] <= now_ms and len(reclaimed) < self._config.max_expired_per_dispatch
        ):
            until_ms, job_id = heapq.heappop(heap)
            entry = self._entries.get(job_id)
            if (
                entry is None
                or entry.status is not JobStatus.LEASED
                or entry.lease_until_ms != until_ms
            ):
                continue
            self._requeue(entry, self._streamed(job_id))
            reclaimed.append(job_id)
        self._num_lease_expirations += len(reclaimed)
        return reclaimed

    async def publish_gateway(self, gateway_id: str, ttl_ms: int) -> None:
        return None  # see enqueue: nothing outlives this process's gateway

    async def settle(self, gateway_id: str, job_ids: Sequence[str]) -> None:
        return None  # nothing to settle: no other gateway could bill this one's jobs

    async def claim_unbilled(self, gateway_id: str, limit: int = 100) -> list[UnbilledJob]:
        return []  # every gateway of this queue is this process

    async def claimed_elsewhere(self, job_ids: Sequence[str]) -> set[str]:
        return set()  # nothing is ever claimed (see claim_unbilled)

    async def cancel(self, job_id: str) -> bool:
        entry = self._entries.get(job_id)
        if entry is None or entry.status not in (JobStatus.QUEUED, JobStatus.LEASED):
            return False
        if entry.status is JobStatus.QUEUED:
            self._unqueue(entry)
        self._finish(entry, JobStatus.CANCELLED, self._clock_ms())
        return True

    async def job_status(self, job_id: str) -> JobStatus | None:
        self._purge(self._clock_ms())
        entry = self._entries.get(job_id)
        if entry is not None:
            return entry.status
        finished = self._finished.get(job_id)
        return None if finished is None else JobStatus(finished[0])

    async def job_progress(self, job_ids: Sequence[str]) -> list[JobProgress]:
        out = []
        for job_id in job_ids:
            entry = self._entries.get(job_id)
            can_stop = True
            if entry is not None:
                status, max_tokens = entry.status, entry.job.params.max_tokens
                can_stop = entry.job.params.can_stop_early
            elif job_id in self._finished:
                done = self._finished[job_id]
                status, max_tokens = JobStatus(done[0]), done[4]
            else:
                continue
            stream = self._streams.get(job_id) or _Stream(self._clock_ms)
            out.append(
                JobProgress(
                    job_id,
                    status,
                    max_tokens=max_tokens,
                    num_tokens=stream.num_tokens,
                    first_token_ms=stream.first_token_ms,
                    last_token_ms=stream.last_token_ms,
                    run_first_token_ms=(
                        stream.first_token_ms
                        if stream.run_first_ms is None
                        else stream.run_first_ms
                    ),
                    run_num_tokens=stream.num_tokens - stream.run_base_tokens,
                    can_stop_early=can_stop,
                )
            )
        return out

    def _finish(self, entry: _Entry, status: JobStatus, now_ms: int) -> None:
        self._give_back_seq(entry)
        job = entry.job
        # The prompt goes with the entry (as the Redis backend empties the job's payload).
        del self._entries[job.job_id]
        self._finished[job.job_id] = (
            status.value,
            job.tier,
            job.tenant_id,
            job.weight,
            job.params.max_tokens,
        )
        num_live = self._num_live_jobs[job.tenant_id] - 1
        if num_live:
            self._num_live_jobs[job.tenant_id] = num_live
        else:
            del self._num_live_jobs[job.tenant_id]
            del self._weights[job.tenant_id]
        heapq.heappush(self._purges, (now_ms + self._finished_ttl_ms, job.job_id))
        heapq.heappush(self._result_purges, (now_ms + self._finished_result_ttl_ms, job.job_id))

    def _purge(self, now_ms: int) -> None:
        while self._result_purges and self._result_purges[0][0] <= now_ms:
            _, job_id = heapq.heappop(self._result_purges)
            self._streams.pop(job_id, None)  # the job stays in _finished: an id is never reused
        while self._purges and self._purges[0][0] <= now_ms:
            _, job_id = heapq.heappop(self._purges)
            self._finished.pop(job_id, None)
            self._streams.pop(job_id, None)

    # -- stats and admission inputs ----------------------------------------------------

    async def depth(self) -> dict[str, TierDepth]:
        return {
            name: TierDepth(
                tier.num_jobs,
                {
                    tenant: TenantDepth(len(q.members), q.num_prefill_tokens, q.num_decode_tokens)
                    for tenant, q in tier.queues.items()
                },
            )
            for name, tier in self._tiers.items()
            if tier.num_jobs
        }

    async def totals(self) -> QueueTotals:
        return QueueTotals(self._num_lease_expirations, self._num_requeues, 0)

    async def counters(self, tier: str) -> dict[str, float]:
        known = self._tiers.get(tier)
        return {} if known is None else dict(known.counters)

    async def work_ahead(
        self, tier: str, tenant_id: str, weight: float, num_prompt_tokens: int = 0
    ) -> WorkAhead:
        return self._work_ahead(tier, tenant_id, weight, num_prompt_tokens)

    def _work_ahead(
        self, tier: str, tenant_id: str, weight: float, num_prompt_tokens: int
    ) -> WorkAhead:
        key = (self._rank(tier), tier)
        prefill = decode = 0.0
        num_jobs = 0
        for name, other in self._tiers.items():
            if name != tier and other.num_jobs and (self._rank(name), name) < key:
                num_jobs += other.num_jobs
                for q in other.queues.values():
                    prefill += q.num_prefill_tokens
                    decode += q.num_decode_tokens
        own = self._tiers.get(tier)
        if own is not None:
            num_jobs += own.num_jobs
            mine = own.queues.get(tenant_id)
            mine_prefill = num_prompt_tokens + (0 if mine is None else mine.num_prefill_tokens)
            for tenant, q in own.queues.items():
                if tenant == tenant_id:
                    prefill += q.num_prefill_tokens
                    decode += q.num_decode_tokens
                    continue
                take = min(q.num_prefill_tokens, mine_prefill * self._weights[tenant] / weight)
                prefill += take
                decode += (
                    q.num_decode_tokens * take / q.num_prefill_tokens if q.num_prefill_tokens else 0
                )
        # Held work no report shows yet: the decode of jobs of its rank or better leased
        # into free slots since their worker's report (seated_decode in lua/_lib.lua).
        self._drop_lapsed_workers(self._clock_ms())
        rank = key[0]
        for worker_id in self._workers:
            for seated_rank, tokens in self._seated.get(worker_id, {}).values():
                if seated_rank <= rank:
                    decode += tokens
        return WorkAhead(prefill, decode, num_jobs)

    async def publish_capacity(
        self,
        worker_id: str,
        *,
        prefill_tokens_per_s: float,
        decode_tokens_per_s: float,
        ttl_ms: int,
        unprefilled_tokens_by_rank: Mapping[int, int] | None = None,
        decode_tokens_by_rank: Mapping[int, int] | None = None,
        num_free_seqs: int = 0,
        release_ms: Sequence[float] | None = None,
        preemptible_by_rank: Mapping[int, int] | None = None,
        waiting_by_rank: Mapping[int, int] | None = None,
        **details: float | None,
    ) -> None:
        self._worker_details[worker_id] = (
            self._clock_ms(),
            worker_details(**details),
        )
        waiting = {int(r): int(n) for r, n in (waiting_by_rank or {}).items()}
        report = FleetCapacity(
            1,
            float(prefill_tokens_per_s),
            float(decode_tokens_per_s),
            {int(r): int(n) for r, n in (unprefilled_tokens_by_rank or {}).items()},
            {int(r): int(n) for r, n in (decode_tokens_by_rank or {}).items()},
            max(0, int(num_free_seqs)),
            None if release_ms is None else tuple(sorted(max(0.0, float(x)) for x in release_ms)),
            (
                (
                    {int(r): int(n) for r, n in (preemptible_by_rank or {}).items()},
                    best_rank_waiting(waiting),
                ),
            ),
            waiting,
        )
        until_ms = self._clock_ms() + ttl_ms
        self._workers[worker_id] = (until_ms, report)
        self._seated.pop(worker_id, None)  # in this report's work now
        self._fleet = None
        self._next_lapse_ms = min(self._next_lapse_ms, until_ms)

    def _take_free_seq(self, worker_id: str) -> bool:
        """A job leased to the worker takes one of the sequence slots it last reported
        free (as dispatch.lua does): admission stops counting it before the next report.
        True if it took one, which the job gives back as it ends (_give_back_seq).

        The job's tokens are not moved to the worker's held work the same way: counted
        there until the next report, those of jobs that finished meanwhile counted too,
        and the simulator's report refused about 50 more latency requests at 1.5x load
        to spare 7 SLO misses (its refusals on batch fell from 99% to 77%)."""
        live = self._workers.get(worker_id)
        if live is None or live[1].num_free_seqs == 0:
            return False
        self._add_free_seqs(worker_id, -1)
        return True

    def _held_now(self, rank: int) -> tuple[int, int, int] | None:
        """(prefill, decode, free slots) of `rank` or better, as the workers' latest
        reports say now, for SloBudget.predict_ms; None with no report to go by (the
        budget's own stand).

        The gateway's budget comes from reports it read up to a moment ago. Counted now
        (enqueue.lua does the same), the free slots are less those leases took since and
        plus those ended jobs gave back, and the decode of the jobs seated in them counts
        in the work ahead (_work_ahead) until a report holds it. From the budget alone, a
        burst arriving a few milliseconds apart saw the same free slots, and was admitted
        past them to wait for releases nobody knew of; and a report that took in the
        seated jobs' work while the gateway still held the report before it counted it
        nowhere."""
        self._drop_lapsed_workers(self._clock_ms())
        if not self._workers:
            return None
        prefill = decode = free = 0
        for _, report in self._workers.values():
            free += report.num_free_seqs
            prefill += sum(n for r, n in report.unprefilled_tokens_by_rank.items() if r <= rank)
            decode += sum(n for r, n in report.decode_tokens_by_rank.items() if r <= rank)
        return prefill, decode, free

    def _give_back_seq(self, entry: _Entry) -> None:
        """The slot a leased job took, free again as its worker lets the job go (it ends,
        is handed back or cancelled), until that worker's next report (free_seq in
        lua/_lib.lua). A job that finished at max_tokens triggers no early report, and
        its slot stayed taken for up to a heartbeat, refusing the next SLO requests."""
        if entry.took_free_seq:
            entry.took_free_seq = False
            self._add_free_seqs(entry.worker_id, 1)
            self._seated.get(entry.worker_id, {}).pop(entry.job.job_id, None)

    def _add_free_seqs(self, worker_id: str, num: int) -> None:
        live = self._workers.get(worker_id)
        if live is not None:
            until_ms, report = live
            free = report.num_free_seqs + num
            self._workers[worker_id] = (until_ms, replace(report, num_free_seqs=free))
            self._fleet = None

    async def fleet_capacity(self) -> FleetCapacity:
        now_ms = self._clock_ms()
        self._drop_lapsed_workers(now_ms)
        fleet = self._fleet or self._sum_fleet()
        self._fleet = fleet
        if fleet.release_ms is None:
            return fleet
        # The releases come nearer as the reports age (as in the Redis queue).
        aged = []
        for worker_id, (_, report) in self._workers.items():
            age_ms = now_ms - self._worker_details[worker_id][0]
            aged.append([max(0.0, ms - age_ms) for ms in report.release_ms or ()])
        return replace(fleet, release_ms=merge_releases(aged))

    def _sum_fleet(self) -> FleetCapacity:
        live = [report for _, report in self._workers.values()]
        unprefilled: dict[int, int] = {}
        decode: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for report in live:
            add_by_rank(unprefilled, report.unprefilled_tokens_by_rank)
            add_by_rank(decode, report.decode_tokens_by_rank)
            add_by_rank(waiting, report.waiting_by_rank)
        return FleetCapacity(
            len(live),
            sum(r.prefill_tokens_per_s for r in live),
            sum(r.decode_tokens_per_s for r in live),
            unprefilled,
            decode,
            sum(r.num_free_seqs for r in live),
            # Releases only if every worker reported its own (an older one does not).
            () if all(r.release_ms is not None for r in live) else None,
            tuple(p for r in live for p in r.preemptible),
            waiting,
        )

    def _drop_lapsed_workers(self, now_ms: int) -> None:
        if now_ms < self._next_lapse_ms:
            return  # no report has lapsed yet
        lapsed = [w for w, (until, _) in self._workers.items() if until <= now_ms]
        for worker_id in lapsed:
            del self._workers[worker_id]
            self._worker_details.pop(worker_id, None)
            self._seated.pop(worker_id, None)
        if lapsed:
            self._fleet = None
        self._next_lapse_ms = min((until for until, _ in self._workers.values()), default=math.inf)

    async def worker_reports(self) -> list[WorkerReport]:
        now_ms = self._clock_ms()
        self._drop_lapsed_workers(now_ms)
        reports = []
        for worker_id, (_, report) in sorted(self._workers.items()):
            published_ms, details = self._worker_details[worker_id]
            reports.append(
                WorkerReport(
                    worker_id,
                    max(0, now_ms - published_ms),
                    report.prefill_tokens_per_s,
                    report.decode_tokens_per_s,
                    unprefilled_tokens_by_rank=dict(report.unprefilled_tokens_by_rank),
                    decode_tokens_by_rank=dict(report.decode_tokens_by_rank),
                    num_free_seqs=report.num_free_seqs,
                    release_ms=report.release_ms or (),
                    num_preemptible_seqs=sum(report.preemptible[0][0].values()),
                    **details,
                )
            )
        return reports

    # -- results -----------------------------------------------------------------------

    def _stream(self, job_id: str) -> _Stream:
        stream = self._streams.get(job_id)
        if stream is None:
            stream = self._streams[job_id] = _Stream(self._clock_ms)
        return stream

    def _streamed(self, job_id: str) -> tuple[int, ...]:
        """Every token in the job's result stream: what its client has been sent."""
        stream = self._streams.get(job_id)
        if stream is None:
            return ()
        return tuple(t for e in stream.events if e.kind is EventKind.TOKENS for t in e.token_ids)

    def _owned(self, job_id: str, worker_id: str | None) -> _Entry | None:
        entry = self._entries.get(job_id)
        if entry is None or entry.status is not JobStatus.LEASED:
            return None
        if worker_id is not None and entry.worker_id != worker_id:
            return None
        return entry

    async def publish_tokens(
        self, job_id: str, worker_id: str, token_ids: Sequence[int], text: str = ""
    ) -> bool:
        if self._owned(job_id, worker_id) is None:
            return False
        self._stream(job_id).append(EventKind.TOKENS, token_ids=tuple(token_ids), text=text)
        return True

    async def publish_step(
        self,
        job_id: str,
        worker_id: str,
        token_ids: Sequence[int],
        text: str = "",
        *,
        finish_reason: str = "",
        queue_wait_ms: float | None = None,
        logprobs: str = "",
    ) -> bool:
        entry = self._owned(job_id, worker_id)
        if entry is None:
            return False
        stream, now_ms = self._stream(job_id), self._clock_ms()
        if token_ids or text:
            stream.append(
                EventKind.TOKENS,
                token_ids=tuple(token_ids),
                text=text,
                queue_wait_ms=queue_wait_ms,
                logprobs=logprobs,
            )
            job = entry.job
            self._charge(job.tier, job.tenant_id, job.weight, 0, len(token_ids), now_ms)
            queue_wait_ms = None  # sent
        if finish_reason:
            stream.append(EventKind.DONE, finish_reason=finish_reason, queue_wait_ms=queue_wait_ms)
            self._finish(entry, JobStatus.DONE, now_ms)
        return True

    async def complete(
        self, job_id: str, *, worker_id: str | None = None, finish_reason: str = "stop"
    ) -> bool:
        entry = self._owned(job_id, worker_id)
        if entry is None:
            return False
        self._stream(job_id).append(EventKind.DONE, finish_reason=finish_reason)
        self._finish(entry, JobStatus.DONE, self._clock_ms())
        return True

    async def fail(
        self, job_id: str, *, code: str, message: str, worker_id: str | None = None
    ) -> bool:
        entry = self._owned(job_id, worker_id)
        if entry is None:
            return False
        self._stream(job_id).append(EventKind.ERROR, code=code, message=message)
        self._finish(entry, JobStatus.FAILED, self._clock_ms())
        return True

    async def results(
        self, job_id: str, after: str = START_CURSOR, *, poll_ms: int = 1000
    ) -> AsyncIterator[ResultEvent]:
        index = int(after)
        while True:
            stream = self._stream(job_id)
            while index < len(stream.events):
                event = stream.events[index]
                index += 1
                yield event
                if event.is_terminal:
                    return
            await stream.changed.wait()

    async def aclose(self) -> None:
        return None
