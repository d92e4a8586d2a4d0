"""Running one batch line: the body is admitted exactly as the live endpoint admits it.

The body goes through the OpenAI routes' own parsing, model check, tokenisation and
context-length check (not the tenant's RPM and TPM, which batch work does not take, nor
its tier's queue limit), becomes a Job at the batch's tier with the batch's deadline, and
is submitted through the dispatcher like any request. A body the live endpoint would
refuse gets the same status code and error body, in the error file; the rest of the
batch runs. Every line that reaches an outcome leaves one UsageRecord at the batch's tier
(and so at its price), which the driver stores in the transaction that stores the
line's result. A line the driver stops (shutdown, lost lease, cancel, expiry) leaves
none: it runs again from the start, or is reported unfinished, and the tenant pays for
the run that finished, not for the one the gateway broke off.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.errors import EngineDeadError, EngineError, RequestAbortedError
from gateway.auth import Principal
from gateway.errors import (
    GatewayError,
    InvalidRequestError,
    error_response,
    unserved_outcome,
)
from gateway.observability.slo import SloTargets
from gateway.openai import routes as openai_routes
from gateway.openai.choices import (
    CollectedChoice,
    RequestPlan,
    first_queue_wait_ms,
    merge_choices,
)
from gateway.openai.exchange import tier_slo, usage_record
from gateway.openai.logprobs import EchoedPrompt
from gateway.openai.responses import FinishedChoice, ResponseShape, Usage
from gateway.openai.schemas import parse_chat_request, parse_completion_request
from gateway.tiers import TierPolicy
from gateway.usage import TokenPrices, UsageRecord
from scheduler.job import Job

CHAT_ENDPOINT = "/v1/chat/completions"


class JobSubmitter(Protocol):
    """The submit/cancel facade the routes use too (the local Dispatcher, or the queue
    client of a Redis fleet): submit returns a stream of outputs with `queue_wait_ms`."""

    def submit(self, job: Job) -> Any: ...

    async def cancel(self, job_id: str) -> Any: ...

    def cancel_soon(self, job_id: str) -> None: ...


@dataclass(frozen=True)
class LineOutcome:
    """A finished line: the response a live request would have got, and its tokens."""

    status_code: int
    request_id: str
    body: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage: UsageRecord | None = None  # its bill, stored with its result

    @property
    def is_success(self) -> bool:
        return self.status_code == 200

    def response(self) -> dict[str, Any]:
        return {"status_code": self.status_code, "request_id": self.request_id, "body": self.body}


class LineRunner:
    """Admits and runs single batch lines through the live endpoint's code path."""

    def __init__(self, routes: openai_routes.OpenAIRoutes, jobs: JobSubmitter) -> None:
        self._routes = routes
        self._jobs = jobs
        # Request id -> its choices' job ids, for the lines running with n > 1.
        self._choice_ids: dict[str, list[str]] = {}

    @property
    def model_name(self) -> str:
        return self._routes.deps.model.model_name

    async def run(
        self,
        *,
        request_id: str,
        principal: Principal,
        tier: TierPolicy,
        endpoint: str,
        body_json: str,
        deadline_s: float,
    ) -> LineOutcome:
        """Run one line to its outcome.

        Raises RequestAbortedError if the job was cancelled (batch cancelled or expired,
        lease lost) and EngineDeadError if the engine is gone: the line then stays
        pending and runs again later.
        """
        started_s = time.monotonic()
        chat = endpoint == CHAT_ENDPOINT
        record = _Record(
            request_id,
            principal.tenant_id,
            tier.name,
            tier_slo(tier),
            tier.prices,
            self.model_name,
            started_s,
        )
        try:
            plan = await self._admit(request_id, principal, tier, body_json, deadline_s, chat=chat)
        except (GatewayError, EngineError) as exc:
            return error_outcome(request_id, exc, record.finish(unserved_outcome(exc)))
        jobs = plan.jobs
        record.prompt_tokens = plan.num_prompt_tokens
        streams = [self._jobs.submit(job) for job in jobs]
        job_ids = [job.job_id for job in jobs]
        if len(jobs) > 1:
            self._choice_ids[request_id] = job_ids
        choices = [CollectedChoice() for _ in jobs]
        record.choice_tokens = [0] * len(jobs)
        try:
            async for index, output in merge_choices(streams):
                if record.first_token_s is None and output.new_token_ids:
                    record.first_token_s = time.monotonic()
                record.choice_tokens[index] = output.num_output_tokens
                choice = choices[index]
                choice.pieces.append(output.text_delta)
                choice.logprobs.extend(output.new_logprobs)
                if output.prompt_logprobs is not None:
                    choice.prompt_logprobs = output.prompt_logprobs
                if output.finished and output.finish_reason is not None:
                    choice.finish_reason = str(output.finish_reason)
        except (RequestAbortedError, EngineDeadError):
            self._cancel_choices(job_ids)
            raise  # not the line's outcome (see the module docstring): no record
        except (GatewayError, EngineError) as exc:
            self._cancel_choices(job_ids)
            return error_outcome(
                request_id, exc, record.finish("error", first_queue_wait_ms(streams))
            )
        except BaseException:
            self._cancel_choices(job_ids)  # the driver offers the line again
            raise
        finally:
            self._choice_ids.pop(request_id, None)
        shape = ResponseShape.for_request(
            request_id, model=self.model_name, service_tier=tier.name, chat=chat
        )
        usage = Usage(record.prompt_tokens, record.completion_tokens)
        return LineOutcome(
            200,
            request_id,
            shape.full(
                [
                    self._choice(c, jobs[0], chat=chat, echoed=plan.echoed_for(index))
                    for index, c in enumerate(choices)
                ],
                usage,
            ),
            record.prompt_tokens,
            record.completion_tokens,
            record.finish("ok", first_queue_wait_ms(streams)),
        )

    def _choice(
        self, choice: CollectedChoice, job: Job, *, chat: bool, echoed: EchoedPrompt | None
    ) -> FinishedChoice:
        with_logprobs = job.params.logprobs is not None
        return self._routes.finished_choice(
            choice, with_logprobs=with_logprobs, chat=chat, echoed=echoed
        )

    def _cancel_choices(self, job_ids: list[str]) -> None:
        """A line with several choices that ends early stops all of them (one job
        alone has ended, or is cancelled by whoever stopped it)."""
        if len(job_ids) > 1:
            for job_id in job_ids:
                self._jobs.cancel_soon(job_id)

    def finished(self, record: UsageRecord) -> None:
        """Count a line whose result (and usage record) is stored in the metrics and the
        dashboard, like a live request of its tier (batch work shows next to what it
        shares with)."""
        self._routes.deps.usage.count_written_elsewhere()
        telemetry = self._routes.deps.telemetry
        if telemetry is not None:
            telemetry.request_finished(record)

    async def cancel(self, request_id: str) -> None:
        """Drop a queued line or abort a running one (its run raises RequestAbortedError)."""
        job_ids = self._choice_ids.get(request_id, [request_id])
        ends = await asyncio.gather(*map(self._jobs.cancel, job_ids), return_exceptions=True)
        for end in ends:
            if isinstance(end, BaseException):
                raise end

    async def _admit(
        self,
        request_id: str,
        principal: Principal,
        tier: TierPolicy,
        body_json: str,
        deadline_s: float,
        *,
        chat: bool,
    ) -> RequestPlan:
        """The jobs of the line's choices, admitted as the live endpoint admits them, and
        what `echo` puts before each choice's text."""
        # The live endpoint's own steps, in its order (see gateway.openai.routes._serve).
        body = body_json.encode("utf-8")
        parsed = parse_chat_request(body) if chat else parse_completion_request(body)
        options = parsed.options
        if options.stream:
            raise InvalidRequestError("stream is not supported in a batch.", param="stream")
        routes = self._routes
        # A service_tier the live endpoint refuses is refused here too (400 unknown, 403
        # above the tenant's); an allowed one changes nothing: lines run at the batch's.
        await routes.resolve_tier(principal, options.service_tier)
        routes.check_model(options.model)
        plan = await routes.plan(
            parsed, len(body), request_id, principal, tier, time.time(), chat=chat
        )
        # The deadline is the batch's (creation + window), not this line's arrival + window.
        # A line waits in the queue as long as that window allows: the tier's queue limit
        # is for a client waiting on a connection (a batch's own window of lines, queued
        # at once, pushed each other past it, and the lines failed with queue_timeout).
        jobs = [replace(job, deadline_s=deadline_s, max_queue_ms=None) for job in plan.jobs]
        return replace(plan, jobs=jobs)


@dataclass
class _Record:
    request_id: str
    tenant_id: str
    tier: str
    slo: SloTargets
    prices: TokenPrices
    model: str
    started_s: float
    prompt_tokens: int = 0
    choice_tokens: list[int] = field(default_factory=lambda: [0])  # each choice's output
    first_token_s: float | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(self.choice_tokens)

    def finish(self, outcome: str, queue_wait_ms: float | None = None) -> UsageRecord:
        return usage_record(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            tier=self.tier,
            model=self.model,
            started_s=self.started_s,
            first_token_s=self.first_token_s,
            prompt_tokens=self.prompt_tokens,
            choice_tokens=self.choice_tokens,
            queue_wait_ms=queue_wait_ms,
            outcome=outcome,
            slo=self.slo,
            prices=self.prices,
        )


def error_outcome(
    request_id: str, exc: BaseException, usage: UsageRecord | None = None
) -> LineOutcome:
    # The one error table decides status and body, as for a live request.
    response = error_response(exc)
    return LineOutcome(
        response.status_code, request_id, json.loads(bytes(response.body)), usage=usage
    )
