"""SLO-aware admission: refuse now what cannot start within its tier's TTFT SLO.

Runs at the gateway after authentication and rate limits, before enqueue. For a tier with
a TTFT SLO it predicts the job's time to first token from the work that would be served
before it and the fleet's measured capacity (the sum of the prefill and decode rates live
workers publish with publish_capacity):

    ttft = (prefill tokens ahead + own prompt) / prefill tokens_per_s
           + the wait for a sequence slot, when none is left for the job

Work ahead is what the queue would dispatch first (QueueBackend.work_ahead, in dispatch
order) plus what the engines already hold for equal or better ranks
(FleetCapacity.backlog_ahead): a dispatcher pulls jobs while its engine has a free
sequence slot, so under overload most of the backlog waits inside the engines for
prefill, out of the queue's sight. Engines serve better ranks first, so their backlog of
a worse rank is not counted.

The job waits for a sequence slot only when none is left for it: workers report how many
requests their engines would start at the next step and how many running preemptible
sequences of each rank a better rank may displace, and while more are free (or
displaceable) than jobs are queued ahead, a new job joins the running batch without
waiting for any decode to end. Otherwise it waits for its turn among the slot releases
the workers expect (scheduler.slot_release: each running request's max_tokens left, and
how often requests stop early, at the engine's step time): the k-th job without a slot
for the k-th release, whatever the rank of the work that holds the slots (a priority job
waits for interactive work it may not preempt). A fleet with a worker that does not
report releases (an older version) counts decode work ahead instead, at a fraction
(decode_ahead_fraction: jobs stop on average before their max_tokens and start once
those ahead are in the batch, not finished). If the prediction exceeds the SLO the job is
refused with the time after which the same request would fit (`retry_after_ms`). A job
whose own prefill alone exceeds the SLO can never fit: it is admitted once nothing is
ahead of it (best effort) and otherwise refused with the time the work ahead needs to
drain (SloBudget.limit_ms), so that honouring the Retry-After gets it served. Tiers
without a TTFT SLO (batch) are bounded only by the queue caps enforced in enqueue
(QueueFullError).

The queue makes the check itself, in the step that enqueues (`admit`, QueueBackend.enqueue
with an SloBudget): gateways admitting at the same moment each see the work the others
just queued, and admission costs the shared queue one round trip, not two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.backend import (
    FleetCapacity,
    QueueBackend,
    SloBudget,
    WorkAhead,
)
from scheduler.job import Job
from scheduler.policy import TierConfig


class AdmissionError(Exception):
    """Base class of admission refusals."""


class NoCapacityError(AdmissionError):
    """No live worker has published its capacity: nothing can serve the request."""


@dataclass(frozen=True)
class AdmissionConfig:
    decode_ahead_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.decode_ahead_fraction <= 1.0:
            raise ValueError("decode_ahead_fraction must be in [0, 1]")


def slo_budget(
    capacity: FleetCapacity, config: AdmissionConfig, *, rank: int, ttft_slo_ms: float
) -> SloBudget:
    """The SLO check a job of tier rank `rank` gets at enqueue, from the fleet's capacity
    (raises NoCapacityError when no live worker reports any)."""
    if capacity.num_workers == 0 or capacity.prefill_tokens_per_s <= 0:
        raise NoCapacityError("no live worker reports any capacity")
    held = capacity.backlog_ahead(rank)
    return SloBudget(
        ttft_slo_ms=ttft_slo_ms,
        prefill_tokens_per_s=capacity.prefill_tokens_per_s,
        decode_tokens_per_s=capacity.decode_tokens_per_s,
        held_prefill_tokens=held.num_prefill_tokens,
        held_decode_tokens=held.num_decode_tokens,
        decode_ahead_fraction=config.decode_ahead_fraction,
        num_free_seqs=capacity.num_free_seqs,
        num_preemptible_seqs=capacity.num_preemptible_seqs(rank),
        release_ms=capacity.release_ms,
        num_waiting_seqs=capacity.num_waiting_ahead(rank),
    )


def job_service_ms(
    capacity: FleetCapacity, config: AdmissionConfig, *, num_prompt_tokens: int, max_tokens: int
) -> float | None:
    """The time the fleet needs for one job's work at its measured rates, counted as work
    ahead is (its prompt, and its decode at decode_ahead_fraction): the expected interval
    at which jobs like it leave the queue or end. None when no live worker reports any
    capacity."""
    if capacity.num_workers == 0 or capacity.prefill_tokens_per_s <= 0:
        return None
    # The TTFT model's own arithmetic, with that one job as all the work and none held.
    budget = SloBudget(
        ttft_slo_ms=math.inf,
        prefill_tokens_per_s=capacity.prefill_tokens_per_s,
        decode_tokens_per_s=capacity.decode_tokens_per_s,
        decode_ahead_fraction=config.decode_ahead_fraction,
    )
    return budget.predict_ms(WorkAhead(num_prompt_tokens, max_tokens), 0)


def predict_ttft_ms(
    work: WorkAhead,
    num_prompt_tokens: int,
    capacity: FleetCapacity,
    config: AdmissionConfig,
    *,
    rank: int,
) -> float:
    """Predicted time to first token of a new job of tier rank `rank`, given the queued
    `work` ahead of it (pure; see the module docstring)."""
    budget = slo_budget(capacity, config, rank=rank, ttft_slo_ms=math.inf)
    return budget.predict_ms(work, num_prompt_tokens)


async def check_slo(
    backend: QueueBackend, job: Job, tier: TierConfig, config: AdmissionConfig | None = None
) -> float | None:
    """Raise SloUnattainableError (or NoCapacityError) if the job cannot meet its tier's
    TTFT SLO; return the predicted TTFT in ms, or None for a tier without a TTFT SLO.
    Reads the queue without changing it; `admit` checks and enqueues in one step."""
    if tier.ttft_slo_ms is None:
        return None
    capacity = await backend.fleet_capacity()
    budget = slo_budget(
        capacity, config or AdmissionConfig(), rank=tier.rank, ttft_slo_ms=tier.ttft_slo_ms
    )
    work = await backend.work_ahead(job.tier, job.tenant_id, job.weight, job.num_prompt_tokens)
    predicted = budget.predict_ms(work, job.num_prompt_tokens)
    refusal = budget.refusal(tier.name, predicted, job.num_prompt_tokens)
    if refusal is not None:
        raise refusal
    return predicted


async def admit(
    backend: QueueBackend,
    job: Job,
    tier: TierConfig,
    config: AdmissionConfig | None = None,
    *,
    capacity: FleetCapacity | None = None,
) -> float | None:
    """SLO admission and enqueue in one atomic queue operation (the queue caps apply
    too). Returns the predicted TTFT (None for a tier without a TTFT SLO). `capacity`
    defaults to the backend's current `fleet_capacity`."""
    budget = None
    if tier.ttft_slo_ms is not None:
        if capacity is None:
            capacity = await backend.fleet_capacity()
        config = config or AdmissionConfig()
        budget = slo_budget(capacity, config, rank=tier.rank, ttft_slo_ms=tier.ttft_slo_ms)
    return await backend.enqueue(job, slo=budget)
