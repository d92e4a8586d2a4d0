"""The queue backend contract shared by the in-memory and the Redis backends.

A gateway `enqueue`s admitted jobs and reads their results; a worker's dispatcher
`dispatch`es (leases) the job the policy picks, `renew`s the lease while it runs,
`publish_tokens` as they are generated (`charge`ing them to the tenant), and ends the job
with `complete` or `fail`. A job whose worker dies returns to the head of its tenant's
queue through `reclaim_expired_leases` and resumes after the tokens already streamed.

A gateway that enqueues names itself (`gateway_id`) and keeps its presence alive with
`publish_gateway`. A job whose gateway has gone (a SIGKILL, a lost host) has no client
left: the queue ends it as cancelled (`abandoned`) where it would otherwise hand it to a
worker (dispatch), keep it there (renew) or requeue it (reclaim), instead of running it
for nobody.

A gateway bills each request it served when the request ends, and `settle`s its jobs
once that usage record is written. The jobs of a gateway that died before it settled
them (served work nobody billed) are taken by another gateway with `claim_unbilled`,
which bills what the queue saw served.

Both backends implement the same operations with identical semantics (a differential
test holds them to it), so the single-process server and a Redis fleet behave alike.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.job import Job
from scheduler.policy import TierConfig
from scheduler.slot_release import nth_release_ms


class QueueError(Exception):
    """Base class of the errors the queue raises on purpose."""


class QueueFullError(QueueError):
    """The tier holds `max_queued_jobs` queued jobs already."""

    def __init__(self, tier: str, max_queued_jobs: int) -> None:
        super().__init__(f"tier {tier!r} already queues {max_queued_jobs} jobs")
        self.tier = tier
        self.max_queued_jobs = max_queued_jobs


class UnknownTierError(QueueError):
    """A job names a tier the queue has no configuration for."""

    def __init__(self, tier: str) -> None:
        super().__init__(f"tier {tier!r} is not configured")
        self.tier = tier


class DuplicateJobError(QueueError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} is already known to the queue")
        self.job_id = job_id


class SloUnattainableError(QueueError):
    """The predicted TTFT exceeds the tier's SLO; retry after `retry_after_ms`."""

    def __init__(
        self, *, tier: str, predicted_ttft_ms: float, ttft_slo_ms: float, retry_after_ms: int
    ) -> None:
        super().__init__(
            f"tier {tier!r} cannot start this request within its {ttft_slo_ms:.0f} ms TTFT SLO "
            f"(predicted {predicted_ttft_ms:.0f} ms); retry in {retry_after_ms} ms"
        )
        self.tier = tier
        self.predicted_ttft_ms = predicted_ttft_ms
        self.ttft_slo_ms = ttft_slo_ms
        self.retry_after_ms = retry_after_ms


class BackendUnavailableError(QueueError):
    """The shared queue (Redis) cannot be reached; callers should fail fast."""


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DROPPED = "dropped"  # queued past max_queue_ms


class EventKind(enum.StrEnum):
    TOKENS = "tokens"
    DONE = "done"  # end of stream, success
    ERROR = "error"  # end of stream, failure (code says why: queue_timeout, engine_error...)


QUEUE_TIMEOUT = "queue_timeout"
# The error event of a job abandoned because its gateway went away: nobody should read
# it, but a gateway that was only cut off from Redis for a while learns what happened.
GATEWAY_LOST = "gateway_lost"
# How long a gateway's presence must have been seen lapsed before its jobs are
# abandoned, by Redis's clock (as the presence lapses). A stopped Redis lapses every
# presence at once; once it runs again, live gateways renew theirs within a second,
# well inside this.
GATEWAY_GRACE_MS = 2_000
# How long a gateway's presence must have been seen lapsed before another gateway bills
# its unsettled jobs (claim_unbilled): long past the abandoning of its jobs, and long
# enough for a gateway that was only cut off from Redis to have written its own records
# (its reads time out within seconds), which the biller then finds and leaves alone.
BILL_GRACE_MS = 15_000


@dataclass(frozen=True)
class ResultEvent:
    """One entry of a job's result stream. `cursor` resumes reading right after it."""

    kind: EventKind
    cursor: str = ""
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str = ""
    code: str = ""
    message: str = ""
    # On the first event a lease publishes: how long the job waited before that lease,
    # measured by the worker from the job's arrival_s (so the gateway needs no event of
    # its own to learn when the job left the queue).
    queue_wait_ms: float | None = None
    # The tokens' log-probabilities (scheduler.logprobs), "" when not asked for.
    logprobs: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.kind is not EventKind.TOKENS


@dataclass(frozen=True)
class UnbilledJob:
    """A served job whose gateway went away before it settled it (claim_unbilled), as
    the queue saw it served: times are epoch ms by Redis's clock, None when its result
    stream holds no such event (expired, or the job never got that far)."""

    job_id: str
    tenant_id: str
    tier: str
    status: JobStatus  # how it ended: done, failed or cancelled (abandoned)
    prompt_tokens: int  # its bill_prompt_tokens (Job): it was leased, so its prompt ran
    output_tokens: int  # the tokens in its result stream
    queue_wait_ms: float | None  # before its first lease
    arrival_ms: int | None
    first_token_ms: int | None
    ended_ms: int | None  # its last event


@dataclass(frozen=True)
class JobProgress:
    """How far a job has run, from its result stream (times are epoch ms by the queue's
    clock; None before its first token).

    A job whose worker died, or handed it back, resumes on another worker after its
    lease lapsed and it was leased again, seconds later: its stream stands still
    meanwhile. Its current run, the lease streaming it now (or the last that streamed),
    is what says how fast it goes on (`pace_s`). Counted from the job's first token
    ever, the pace took in that lapse: a tenant was told 60 s for a wait of 13 s."""

    job_id: str
    status: JobStatus
    max_tokens: int
    num_tokens: int  # streamed so far, by all its runs
    first_token_ms: int | None  # of its first run
    last_token_ms: int | None
    # Its current run's first event, and the tokens that run has streamed (num_tokens
    # less those of the runs before). For a job that ran once, or was resumed by a
    # worker of an older release (which marks no run), first_token_ms and num_tokens.
    run_first_token_ms: int | None
    run_num_tokens: int
    # Whether it may stop before its max_tokens (SamplingParams.can_stop_early); the
    # Redis queue does not say (its parameters are in the job's JSON): True there.
    can_stop_early: bool = True
    # Its gateway has stopped renewing its presence (it died): whatever becomes of the
    # job, nobody is left to hand back what the gateway held for it.
    is_orphaned: bool = False

    def pace_s(self, min_tokens: int) -> float | None:
        """Seconds per token of its current run, from that run's first event to the
        job's last; None until the run has streamed `min_tokens` tokens (its first
        steps run behind prefills)."""
        first, last, made = self.run_first_token_ms, self.last_token_ms, self.run_num_tokens
        if first is None or last is None or made < max(min_tokens, 2):
            return None
        return (last - first) / 1000.0 / (made - 1)


@dataclass(frozen=True)
class QueueTotals:
    """What happened to leased jobs since the queue began (operators watch the rates)."""

    lease_expirations: int = 0  # leases that ran out (their worker died or stalled)
    requeues: int = 0  # jobs their worker handed back (a drain, an engine that stopped)
    abandoned: int = 0  # jobs ended because their gateway went away


@dataclass(frozen=True)
class TenantDepth:
    num_jobs: int
    num_prefill_tokens: int
    num_decode_tokens: int  # max_tokens of the queued jobs


@dataclass(frozen=True)
class TierDepth:
    num_jobs: int
    tenants: dict[str, TenantDepth] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkAhead:
    """Work the policy would serve before a new job of a given tenant and tier."""

    num_prefill_tokens: int
    num_decode_tokens: int
    # Jobs queued in better tiers and in the job's own (all of them: a bound, counted the
    # same way by both backends): they take free sequence slots before the job does.
    num_jobs: int = 0


@dataclass(frozen=True)
class SloBudget:
    """What `enqueue` needs to refuse a job that would miss its tier's TTFT SLO, in the
    same atomic step that queues it (scheduler/admission.py explains the prediction):
    the fleet's rates, the work engines hold ahead of the job's rank, and the SLO.

    Checked apart from the enqueue, every gateway admitting at the same moment would see
    the same queue and all of them would admit; checked inside it, each sees the others.
    """

    ttft_slo_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    held_prefill_tokens: int = 0
    held_decode_tokens: int = 0
    decode_ahead_fraction: float = 0.5
    # Sequence slots the engines would fill at their next step (FleetCapacity).
    num_free_seqs: int = 0
    # Running sequences a job of this rank may preempt, and the waits for the next slot
    # releases (None: a worker did not report them) (FleetCapacity).
    num_preemptible_seqs: int = 0
    release_ms: tuple[float, ...] | None = None
    # Requests the engines hold without a slot, ahead of the job in the line for one.
    num_waiting_seqs: int = 0

    def predict_ms(
        self,
        work: WorkAhead,
        num_prompt_tokens: int,
        held: tuple[int, int, int] | None = None,
    ) -> float:
        """Predicted TTFT of a job of `num_prompt_tokens` with `work` queued ahead of it.
        The Redis queue computes the same in Lua (slo_predict in scheduler/lua/_lib.lua).
        `held`: (held prefill tokens, held decode tokens, free slots) to use instead of
        the budget's, as the queue counts them when it enqueues.

        The job waits for a sequence slot only when none is left after the jobs queued
        ahead took theirs, counting the slots it may take by preempting worse,
        preemptible work: otherwise it joins the running batch at once and only the
        prefill ahead of it counts. (Decodes counted always, one long generation on an
        idle engine refused every request of an SLO tier.) Waiting, it waits for the
        decode ahead of it to thin out (decode tokens of its rank or better, at
        decode_ahead_fraction), and at least for its turn among the slot releases the
        engines expect (`release_ms`, scheduler.slot_release): the k-th job without a
        slot for the k-th release. Without that floor a priority request that found the
        engines full of interactive work, which it may not preempt, was predicted at its
        own prefill, admitted, and waited 20 s against a 300 ms SLO. (The releases alone,
        which are expectations, admitted more requests into an overloaded simulated
        fleet than met their SLO: the decode estimate errs long, and keeps the margin.)"""
        held_prefill, held_decode, num_free = held or (
            self.held_prefill_tokens,
            self.held_decode_tokens,
            self.num_free_seqs,
        )
        num_prefill = work.num_prefill_tokens + held_prefill + num_prompt_tokens
        prefill_ms = 1000.0 * (num_prefill / self.prefill_tokens_per_s)
        # Jobs ahead (queued, and held by engines without a slot) still without one
        # once the free slots and those it may take by preemption are gone: the job
        # waits for release number `num_seated`.
        num_ahead = work.num_jobs + self.num_waiting_seqs
        num_seated = num_ahead - num_free - self.num_preemptible_seqs
        if num_seated < 0:
            return prefill_ms
        num_decode = work.num_decode_tokens + held_decode
        decode_ms = 0.0
        if num_decode and self.decode_tokens_per_s > 0:
            decode_ms = 1000.0 * (
                self.decode_ahead_fraction * num_decode / self.decode_tokens_per_s
            )
        if self.release_ms is None:
            return prefill_ms + decode_ms
        return prefill_ms + max(decode_ms, nth_release_ms(self.release_ms, num_seated))

    def alone_ms(self, num_prompt_tokens: int) -> float:
        """The job's predicted TTFT with nothing ahead of it: its own prefill."""
        return 1000.0 * num_prompt_tokens / self.prefill_tokens_per_s

    def limit_ms(self, num_prompt_tokens: int) -> float:
        """The most a job's predicted TTFT may be to be admitted: the SLO, or the job's
        own prefill when that alone exceeds the SLO (a prompt too long for the tier's
        SLO at the fleet's speed is served once nothing is ahead of it, at best effort,
        instead of being told to come back forever). The Lua mirror is in enqueue.lua."""
        return max(self.ttft_slo_ms, self.alone_ms(num_prompt_tokens))

    def refusal(
        self, tier: str, predicted_ms: float, num_prompt_tokens: int
    ) -> SloUnattainableError | None:
        """The error refusing a job predicted at `predicted_ms`, or None if it fits. Its
        wait is the time the work ahead needs to drain below the limit."""
        limit_ms = self.limit_ms(num_prompt_tokens)
        if predicted_ms <= limit_ms:
            return None
        return SloUnattainableError(
            tier=tier,
            predicted_ttft_ms=predicted_ms,
            ttft_slo_ms=self.ttft_slo_ms,
            retry_after_ms=math.ceil(predicted_ms - limit_ms),
        )


@dataclass(frozen=True)
class FleetCapacity:
    """The sum of the measured rates of live workers, and of the work their engines hold.

    A dispatcher pulls jobs while its engine has a free sequence slot, so under overload
    much of the backlog has left the queue and waits inside engines for prefill; the
    per-rank totals let admission count it (`backlog_ahead`).
    """

    num_workers: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    # Prompt tokens engines hold but have not prefilled (waiting, partly prefilled,
    # preempted), per request rank.
    unprefilled_tokens_by_rank: Mapping[int, int] = field(default_factory=dict)
    # Tokens the engines' requests may still generate (max_tokens left), per rank.
    decode_tokens_by_rank: Mapping[int, int] = field(default_factory=dict)
    # Requests the engines would start at their next step if they arrived now (0 from a
    # worker that does not say): a newcomer that finds one waits for no decode to end.
    num_free_seqs: int = 0
    # The waits for the fleet's next slot releases, ascending, less the reports' age
    # (scheduler.slot_release); None when a live worker did not report its own.
    release_ms: tuple[float, ...] | None = None
    # Per live worker, (running preemptible sequences per rank, the best rank waiting in
    # its engine): what a new request may take by preemption (num_preemptible_seqs).
    preemptible: tuple[tuple[Mapping[int, int], float], ...] = ()
    # Requests engines hold without a slot (waiting, preempted), per rank.
    waiting_by_rank: Mapping[int, int] = field(default_factory=dict)

    def num_waiting_ahead(self, rank: int) -> int:
        """Requests engines hold without a slot that a new request of `rank` would find
        ahead of it in the line for one: those of its rank or better."""
        return sum(n for r, n in self.waiting_by_rank.items() if r <= rank)

    def num_preemptible_seqs(self, rank: int) -> int:
        """Running sequences a new request of `rank` would displace at once: preemptible
        ones of a worse rank, on engines where nothing of its rank or better waits."""
        return sum(
            sum(n for r, n in by_rank.items() if r > rank)
            for by_rank, best_waiting in self.preemptible
            if rank < best_waiting
        )

    def backlog_ahead(self, rank: int) -> WorkAhead:
        """Engine-held work an engine serves before a new request of `rank`: that of
        equal or better rank, in full (engines run better ranks first)."""
        return WorkAhead(
            sum(n for r, n in self.unprefilled_tokens_by_rank.items() if r <= rank),
            sum(n for r, n in self.decode_tokens_by_rank.items() if r <= rank),
        )


@dataclass(frozen=True)
class WorkerReport:
    """One live worker's latest capacity report (it publishes one every heartbeat)."""

    worker_id: str
    age_ms: int  # since the report was published, by the queue's clock
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    # Sequences in the worker's engine; None when the worker did not say.
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None  # share of KV-cache blocks in use
    unprefilled_tokens_by_rank: Mapping[int, int] = field(default_factory=dict)
    decode_tokens_by_rank: Mapping[int, int] = field(default_factory=dict)
    step_token_budget: int | None = None
    num_preemptions: int | None = None  # since the worker started
    num_recomputed_tokens: int | None = None  # since the worker started
    num_free_seqs: int = 0  # requests its engine would start at its next step
    # The waits for its next slot releases as reported, and its running preemptible
    # sequences (FleetCapacity.release_ms and .preemptible).
    release_ms: tuple[float, ...] = ()
    num_preemptible_seqs: int = 0


# The operator-facing fields of a worker's report (WorkerReport), with their types.
WORKER_DETAIL_TYPES: dict[str, type] = {
    "num_running": int,
    "num_waiting": int,
    "kv_cache_usage": float,
    "step_token_budget": int,
    "num_preemptions": int,
    "num_recomputed_tokens": int,
}


def worker_details(**values: Any) -> dict[str, Any]:
    """Those fields from `values` as their types; None where the worker did not say."""
    unknown = set(values) - WORKER_DETAIL_TYPES.keys()
    if unknown:
        raise TypeError(f"unknown worker report fields: {sorted(unknown)}")
    return {
        name: None if values.get(name) is None else kind(values[name])
        for name, kind in WORKER_DETAIL_TYPES.items()
    }


def best_rank_waiting(waiting_by_rank: Mapping[int, int]) -> float:
    """The best rank with a request waiting for a slot (inf: none waits)."""
    return min((rank for rank, num in waiting_by_rank.items() if num > 0), default=math.inf)


def add_by_rank(total: dict[int, int], part: Mapping[int, int]) -> dict[int, int]:
    """Add one worker's per-rank counts into a fleet total (returns `total`)."""
    for rank, num in part.items():
        total[rank] = total.get(rank, 0) + num
    return total


START_CURSOR = "0"


class QueueBackend(Protocol):
    """The shared queue, its leases and the per-request result channels."""

    async def configure_tiers(self, tiers: Sequence[TierConfig]) -> None:
        """Replace the tier table; takes effect at the next dispatch in every process."""
        ...

    async def get_tiers(self) -> list[TierConfig]: ...

    async def enqueue(
        self, job: Job, *, slo: SloBudget | None = None, gateway_id: str | None = None
    ) -> float | None:
        """Queue an admitted job. Raises UnknownTierError, SloUnattainableError (only with
        `slo`), DuplicateJobError, QueueFullError, checked in that order.

        With `slo`, the work the policy would serve first is read and the job refused if
        its predicted TTFT exceeds the SLO, atomically with queueing it; returns that
        prediction in ms (None without `slo`). With `gateway_id`, the job is abandoned
        once that gateway's presence (`publish_gateway`) has lapsed."""
        ...

    async def publish_gateway(self, gateway_id: str, ttl_ms: int) -> None:
        """The gateway is alive for ttl_ms more (publish again to stay so). Once it has
        lapsed for GATEWAY_GRACE_MS, its jobs are abandoned: finished as cancelled, with
        an error event of code GATEWAY_LOST, at their next dispatch, lease renewal or
        reclaim. A gateway that is shutting down lapses itself with ttl_ms=1."""
        ...

    async def settle(self, gateway_id: str, job_ids: Sequence[str]) -> None:
        """The usage of these jobs, queued by `gateway_id` with a `bill_prompt_tokens`,
        is written: claim_unbilled leaves them alone. Ids it does not track are ignored."""
        ...

    async def claim_unbilled(self, gateway_id: str, limit: int = 100) -> list[UnbilledJob]:
        """For `gateway_id` to bill: up to `limit` served jobs that other gateways
        queued with a `bill_prompt_tokens` and never settled, whose gateway's presence
        has lapsed for BILL_GRACE_MS and which have ended. Each is claimed once (whoever
        claims it must bill it); a job of theirs that never left the queue served
        nothing and is dropped unbilled. Empty where no gateway can die alone (the
        in-memory queue lives in its gateway's process)."""
        ...

    async def claimed_elsewhere(self, job_ids: Sequence[str]) -> set[str]:
        """Those of `job_ids` that claim_unbilled gave another gateway to bill (their
        own gateway looked gone that long, and was only unresponsive)."""
        ...

    async def dispatch(self, worker_id: str, lease_ms: int) -> Job | None:
        """Lease the job the policy picks (None when nothing is queued).

        Charges its prompt tokens to the tenant on its first lease. The job's `rank` is the
        tier's current rank and `resumed_token_ids` holds what the client already has.
        Jobs queued past their max_queue_ms are dropped first, ending their result stream
        with an error event of code `queue_timeout`.
        """
        ...

    async def dispatch_many(self, worker_id: str, lease_ms: int, num_jobs: int) -> list[Job]:
        """Up to num_jobs dispatches in policy order, each as `dispatch` would make it at
        the same moment (fewer when the queue runs dry), in one call."""
        ...

    async def charge(self, job_id: str, *, input_tokens: int = 0, output_tokens: int = 0) -> bool:
        """Add served tokens to the tenant's counter, divided by its current weight (see
        `set_tenant_weight`), and to the tier's share window."""
        ...

    async def set_tenant_weight(self, tenant_id: str, weight: float) -> bool:
        """Change the fair-share weight of a tenant's queued and leased jobs, in every
        tier: their charges from now on divide by it (counters are not rescaled; what
        was served stays charged at the old weight). Every enqueue also sets the weight,
        to its job's. False, with nothing stored, when the tenant has no such job: its
        next enqueue brings the weight. PolicyConfigError unless the weight is > 0."""
        ...

    async def tenant_weight(self, tenant_id: str) -> float | None:
        """The weight the tenant's charges divide by; None when it has no queued or
        leased job."""
        ...

    async def renew(self, worker_id: str, job_id: str, lease_ms: int) -> bool:
        """Extend a lease; False means the worker lost the job (cancelled, abandoned or
        reclaimed)."""
        ...

    async def requeue(self, job_id: str, *, worker_id: str | None = None) -> bool:
        """Put a leased job back at its place (ahead of later arrivals) in its tenant's
        queue. It resumes after the tokens in its result stream: what the client has,
        whatever the worker believes it published."""
        ...

    async def reclaim_expired_leases(self, now_ms: int | None = None) -> list[str]:
        """Requeue jobs whose lease ran out; each resumes after the tokens it streamed.
        Returns the requeued ids (a job whose gateway has gone is abandoned instead)."""
        ...

    async def cancel(self, job_id: str) -> bool:
        """Drop a queued or leased job (its client went away)."""
        ...

    async def job_status(self, job_id: str) -> JobStatus | None: ...

    async def job_progress(self, job_ids: Sequence[str]) -> list[JobProgress]:
        """The progress of those of `job_ids` the queue knows (queued, leased or ended
        within its finished TTL), in order."""
        ...

    async def depth(self) -> dict[str, TierDepth]: ...

    async def totals(self) -> QueueTotals:
        """Lease expirations, requeues and abandoned jobs since the queue began."""
        ...

    async def counters(self, tier: str) -> dict[str, float]:
        """Every known tenant's virtual token counter in a tier (for fairness reports)."""
        ...

    async def work_ahead(
        self, tier: str, tenant_id: str, weight: float, num_prompt_tokens: int = 0
    ) -> WorkAhead:
        """Queued work the policy would serve before a new job of this tenant, and the
        decode of jobs of its rank or better leased into free slots since their
        worker's last report (held work no report shows yet)."""
        ...

    async def publish_tokens(
        self, job_id: str, worker_id: str, token_ids: Sequence[int], text: str = ""
    ) -> bool:
        """Append tokens to the result stream; False if the worker no longer holds the job."""
        ...

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
        """One engine step of a leased job, atomically: its tokens event (when there are
        tokens or text), their charge to the tenant and, with a `finish_reason`, the done
        event that finishes the job. `queue_wait_ms` (the lease's first step, and only
        that) goes with the first of those events, which begins the job's current run
        if it resumes a job that streamed tokens before (JobProgress.run_first_token_ms),
        and `logprobs` (encoded, scheduler.logprobs) with the tokens (ResultEvent).
        False, with nothing written, when `worker_id` no longer holds the job."""
        ...

    async def complete(
        self, job_id: str, *, worker_id: str | None = None, finish_reason: str = "stop"
    ) -> bool:
        """End the stream with a done event and finish the job, atomically."""
        ...

    async def fail(
        self, job_id: str, *, code: str, message: str, worker_id: str | None = None
    ) -> bool:
        """End the stream with an error event and finish the job, atomically."""
        ...

    def results(
        self, job_id: str, after: str = START_CURSOR, *, poll_ms: int = 1000
    ) -> AsyncIterator[ResultEvent]:
        """Events after cursor `after`, waiting for new ones, up to the terminal event."""
        ...

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
        """A worker's measured rates, its engine's backlog per rank (EngineStats), the
        requests it would start at its next step, and the waits for its next slot
        releases with its running preemptible sequences per rank and its requests
        waiting for a slot per rank
        (scheduler.slot_release; `release_ms` None: not reported, as by an older
        worker); they count for ttl_ms (publish again
        to stay live). A report replaces the worker's previous one. `details`: the
        WORKER_DETAIL_TYPES fields (sequence counts, KV-cache use, step budget,
        preemption counters), shown to operators (`worker_reports`, the gateways'
        metrics and dashboard), not used by admission; any other name is a TypeError."""
        ...

    async def fleet_capacity(self) -> FleetCapacity: ...

    async def worker_reports(self) -> list[WorkerReport]:
        """The latest report of every live worker, by worker id."""
        ...

    async def aclose(self) -> None: ...
