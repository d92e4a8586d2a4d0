"""The unit of work that crosses the queue: everything a worker needs, no database.

A job is admitted by a gateway, queued, leased by a worker and run by its engine. It is
serialised to JSON for the Redis backend, so it holds only plain values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.request import SamplingParams

# SamplingParams fields added since the release before: a job's JSON leaves them out at
# their default, so a worker of that release (a rolling upgrade runs both), whose
# SamplingParams refuses a field it does not know, reads every job that does not use
# them. Every other field is always written: that release reads some without a default.
NEWER_PARAMS = frozenset({"prompt_logprobs", "min_p", "repetition_penalty", "min_tokens"})


@dataclass(frozen=True)
class Job:
    job_id: str  # also the request id seen by the client (x-request-id)
    tenant_id: str
    tier: str
    rank: int  # 0 is most important
    weight: float  # tenant's fair-share weight
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_s: float  # wall-clock epoch seconds at the gateway
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    max_queue_ms: float | None = None  # dropped with queue_timeout past this
    deadline_s: float | None = None  # batch completion deadline (epoch seconds)
    preemptible: bool = False
    # Tokens already streamed to the client by an earlier lease; a resumed job continues
    # after them so the client sees no duplicate and no gap.
    resumed_token_ids: tuple[int, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    # The prompt tokens the queue bills for this job should its gateway go before it has
    # written the request's usage record (QueueBackend.claim_unbilled): a live request's
    # first choice of each prompt carries its prompt, the other choices 0 (the prompt is
    # billed once). None: not tracked (a Batch API line, which a gateway that takes the
    # batch over runs again). Read by the queue at enqueue; not part of the JSON workers
    # read (an older worker refuses a field it does not know).
    bill_prompt_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    def with_resumed(self, token_ids: tuple[int, ...]) -> Job:
        return replace(self, resumed_token_ids=token_ids)

    def to_json(self) -> str:
        # A shallow dict: asdict() deep-copies the token tuples, which dominated the
        # queue's client-side cost.
        data: dict[str, Any] = {name: getattr(self, name) for name in _JSON_FIELDS}
        # asdict() deep-copies too; the params are flat, so a field read is enough.
        params = self.params
        data["params"] = {
            f.name: value
            for f in fields(params)
            if (value := getattr(params, f.name)) != f.default or f.name not in NEWER_PARAMS
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Job:
        data = json.loads(raw)
        p = data.pop("params")
        params = SamplingParams(
            **{
                **p,
                "stop": tuple(p.get("stop", ())),
                "stop_token_ids": tuple(p.get("stop_token_ids", ())),
            }
        )
        return cls(
            **{
                **data,
                "params": params,
                "prompt_token_ids": tuple(data["prompt_token_ids"]),
                "resumed_token_ids": tuple(data["resumed_token_ids"]),
            }
        )


# What a job's JSON holds: every field but the queue's own.
_JSON_FIELDS = tuple(f.name for f in fields(Job) if f.name != "bill_prompt_tokens")
