"""The job a validated request becomes, and the checks on it that need its tier."""

from __future__ import annotations

from engine.request import SamplingParams
from gateway.auth import Principal
from gateway.errors import InvalidRequestError
from gateway.openai.schemas import GenerationOptions
from gateway.tiers import TierPolicy
from scheduler.job import Job


def check_choices(n: int, tier: TierPolicy, principal: Principal, *, num_prompts: int = 1) -> None:
    """A 400 for more choices than could ever run: each is a job the tier's queue must
    hold, and a sequence that takes one of the tenant's concurrency slots; refused as
    "not now" (429), the request would be refused however long the client waited.
    Several prompts each have n choices."""
    total = n * num_prompts
    asked = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n}"
    param = "n" if num_prompts == 1 else "prompt"
    cap = tier.max_queued_jobs
    if cap is not None and total > cap:
        raise InvalidRequestError(
            f"{asked} is more choices than the {tier.name!r} tier queues at once ({cap}).",
            param=param,
        )
    slots = principal.max_concurrency
    if slots is not None and total > slots:
        raise InvalidRequestError(
            f"{asked} choices run as {total} concurrent sequences, more than this key's "
            f"concurrency limit of {slots}.",
            param=param,
            code="exceeds_concurrency_limit",
        )


def build_job(
    request_id: str,
    principal: Principal,
    tier: TierPolicy,
    prompt_ids: list[int],
    params: SamplingParams,
    arrival_s: float,
    options: GenerationOptions,
) -> Job:
    deadline_s = None
    if tier.completion_window_s is not None:
        deadline_s = arrival_s + tier.completion_window_s
    metadata = {"user": options.user} if options.user else {}
    return Job(
        job_id=request_id,
        tenant_id=principal.tenant_id,
        tier=tier.name,
        rank=tier.rank,
        weight=principal.weight,
        prompt_token_ids=tuple(prompt_ids),
        params=params,
        arrival_s=arrival_s,
        ttft_slo_ms=tier.ttft_slo_ms,
        tpot_slo_ms=tier.tpot_slo_ms,
        max_queue_ms=tier.max_queue_ms,
        deadline_s=deadline_s,
        preemptible=tier.preemptible,
        metadata=metadata,
    )
