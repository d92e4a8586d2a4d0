"""SLO-aware admission: refuse now what cannot start within its tier's TTFT SLO.

Runs at the gateway after authentication and rate limits, before enqueue. For a tier with
a TTFT SLO it predicts the job's time to first token from the work that would be served
before it and the fleet's measured capacity (the sum of the prefill and decode rates live
workers publish with publish_capacity):

    ttft = (prefill tokens ahead + own prompt) / prefill tokens_per_s
           + decode_ahead_fraction * decode tokens ahead / decode tokens_per_s

Work ahead is what the queue would dispatch first (QueueBackend.work_ahead, in dispatch
order) plus what the engines already hold for equal or better ranks
(FleetCapacity.backlog_ahead): a dispatcher pulls jobs while its engine has a free
sequence slot, so under overload most of the backlog waits inside the engines for
prefill, out of the queue's sight. Engines serve better ranks first, so their backlog of
a worse rank is not counted.

Decode work ahead counts at a fraction because jobs ahead stop on average before their
max_tokens and, with continuous batching, a job starts once those ahead have been
admitted to the batch, not finished. If the prediction exceeds the SLO the job is refused
with the time after which the same request would fit (`retry_after_ms`). Tiers without a
TTFT SLO (batch) are bounded only by the queue caps enforced in enqueue (QueueFullError).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.backend import FleetCapacity, QueueBackend, WorkAhead
from scheduler.job import Job
from scheduler.policy import TierConfig


class AdmissionError(Exception):
    """Base class of admission refusals."""


class SloUnattainableError(AdmissionError):
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


class NoCapacityError(AdmissionError):
    """No live worker has published its capacity: nothing can serve the request."""


@dataclass(frozen=True)
class AdmissionConfig:
    decode_ahead_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.decode_ahead_fraction <= 1.0:
            raise ValueError("decode_ahead_fraction must be in [0, 1]")


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
    if capacity.num_workers == 0 or capacity.prefill_tokens_per_s <= 0:
        raise NoCapacityError("no live worker reports any capacity")
    held = capacity.backlog_ahead(rank)
    num_prefill = work.num_prefill_tokens + held.num_prefill_tokens + num_prompt_tokens
    num_decode = work.num_decode_tokens + held.num_decode_tokens
    prefill_s = num_prefill / capacity.prefill_tokens_per_s
    decode_s = 0.0
    if num_decode and capacity.decode_tokens_per_s > 0:
        decode_s = config.decode_ahead_fraction * num_decode / capacity.decode_tokens_per_s
    return 1000.0 * (prefill_s + decode_s)


async def check_slo(
    backend: QueueBackend, job: Job, tier: TierConfig, config: AdmissionConfig | None = None
) -> float | None:
    """Raise SloUnattainableError (or NoCapacityError) if the job cannot meet its tier's
    TTFT SLO; return the predicted TTFT in ms, or None for a tier without a TTFT SLO."""
    if tier.ttft_slo_ms is None:
        return None
    capacity = await backend.fleet_capacity()
    work = await backend.work_ahead(job.tier, job.tenant_id, job.weight, job.num_prompt_tokens)
    predicted = predict_ttft_ms(
        work, job.num_prompt_tokens, capacity, config or AdmissionConfig(), rank=tier.rank
    )
    if predicted > tier.ttft_slo_ms:
        raise SloUnattainableError(
            tier=tier.name,
            predicted_ttft_ms=predicted,
            ttft_slo_ms=tier.ttft_slo_ms,
            retry_after_ms=math.ceil(predicted - tier.ttft_slo_ms),
        )
    return predicted


async def admit(
    backend: QueueBackend, job: Job, tier: TierConfig, config: AdmissionConfig | None = None
) -> float | None:
    """check_slo, then enqueue (which enforces the queue caps). Returns the predicted TTFT."""
    predicted = await check_slo(backend, job, tier, config)
    await backend.enqueue(job)
    return predicted
