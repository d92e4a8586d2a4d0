"""/v1/models, /v1/completions and /v1/chat/completions.

Admission in order: key -> tenant -> tier (service_tier may only go down); body ->
typed request; model and context length; then a Job per choice (`n`) into the queue.
The dispatcher runs them on the engine and the route streams (SSE) or collects the
outputs. A client that goes away, or is answered with an error, cancels its jobs. Every
admitted request leaves one UsageRecord.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from engine.errors import (
    ContextLengthExceededError,
    EngineError,
    PromptTooLongError,
    RequestAbortedError,
)
from engine.request import SamplingParams, TokenLogprob
from gateway.admission import Admission
from gateway.auth import KeyAuthenticator, Principal
from gateway.errors import (
    CLIENT_CLOSED_REQUEST,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    error_code,
    error_response,
    unserved_outcome,
)
from gateway.middleware import request_id_of
from gateway.observability import Telemetry
from gateway.observability.slo import billed_tokens
from gateway.openai.choices import CollectedChoice, RequestPlan, choice_jobs, merge_choices
from gateway.openai.echo import echoed_prompt
from gateway.openai.exchange import Exchange, tier_slo
from gateway.openai.jobs import build_job, check_choices
from gateway.openai.logprobs import EchoedPrompt, LogprobsWriter, TokenTexts
from gateway.openai.responses import SSE_DONE, FinishedChoice, ResponseShape, Usage
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationOptions,
    Prompt,
    parse_chat_request,
    parse_completion_request,
)
from gateway.tiers import TierCatalog, TierPolicy
from gateway.usage import UsageWriter
from scheduler.job import Job
from scheduler.results import JobClient, JobStream, QueueTimeoutError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# service_tier values the official client sends that mean "my own tier".
OWN_TIER_ALIASES = frozenset({"auto", "default"})
# Bodies from this size on are tokenized in a worker thread: below it tokenizing takes
# well under a millisecond, less than the hand-over to a thread costs.
OFF_LOOP_MIN_BODY_BYTES = 32 * 1024
OFF_LOOP_SLOTS = 2
# Echoed prompts from this many tokens on have their offsets counted in a worker thread
# (about 2 us a token: 1,000 tokens cost the event loop 2 ms).
OFF_LOOP_MIN_ECHO_TOKENS = 1_000

T = TypeVar("T")

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def detokenizer(self, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> Any: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


class ModelInfo(Protocol):
    """What the routes need from the engine: its name, context and tokenizer."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer


@dataclass(frozen=True)
class OpenAIDeps:
    auth: KeyAuthenticator
    tiers: TierCatalog
    model: ModelInfo
    dispatcher: JobClient  # enqueues jobs and follows their results
    usage: UsageWriter
    created_s: int  # advertised as the model's `created`
    telemetry: Telemetry | None = None  # metrics and traces of each finished request
    # Rate limits and SLO admission; None admits everything (harnesses).
    admission: Admission | None = None


class ClientDisconnectedError(Exception):
    """The client closed the connection before its response was complete."""


class OpenAIRoutes:
    """The handlers; one instance per app, holding only its dependencies."""

    def __init__(self, deps: OpenAIDeps) -> None:
        self.deps = deps
        # Large prompts tokenized at once in worker threads; more wait their turn.
        self._off_loop_slots = asyncio.Semaphore(OFF_LOOP_SLOTS)
        self._token_texts: TokenTexts | None = None

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.deps.model.model_name,
            "object": "model",
            "created": self.deps.created_s,
            "owned_by": "tiergate",
            # vLLM's field: what a client fits its prompt and max_tokens into.
            "max_model_len": self.deps.model.max_model_len,
        }

    async def list_models(self, request: Request) -> Response:
        await self.deps.auth.authenticate(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        await self.deps.auth.authenticate(request.headers.get("authorization"))
        self.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        started_s = time.monotonic()
        arrival_s = time.time()
        request_id = request_id_of(request.scope)
        principal = await self.deps.auth.authenticate(request.headers.get("authorization"))
        exchange = Exchange(
            request_id, principal, principal.tier.name, self.deps.model.model_name, started_s
        )
        try:
            body = await request.body()
            parsed = parse_chat_request(body) if chat else parse_completion_request(body)
            options = parsed.options
            tier = await self.resolve_tier(principal, options.service_tier)
            exchange.tier, exchange.slo, exchange.prices = tier.name, tier_slo(tier), tier.prices
            self.check_model(options.model)
            plan = await self.plan(
                parsed, len(body), request_id, principal, tier, arrival_s, chat=chat
            )
            plan = plan.billed_by_queue()
            exchange.num_prompt_tokens = plan.num_prompt_tokens
            exchange.choice_tokens = [0] * len(plan.jobs)
            headers = await self._admit(
                exchange, plan, tier, max_tokens_given=options.max_tokens is not None
            )
        except ClientDisconnect:
            self._finish(exchange, "aborted")  # gone before its body arrived
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (GatewayError, EngineError) as exc:
            self._finish(exchange, unserved_outcome(exc))
            raise
        shape = ResponseShape.for_request(
            request_id, model=self.deps.model.model_name, service_tier=tier.name, chat=chat
        )
        outputs = merge_choices(exchange.streams)
        try:
            if options.stream:
                # Wait for the first output before answering, so that an error raised
                # before any token (engine refusal, shutdown) still gets its status code.
                first = await self._unless_disconnected(request, _next_or_none(outputs))
            else:
                collected = await self._unless_disconnected(
                    request, self._collect(exchange, outputs)
                )
        except ClientDisconnectedError:
            await self._finish_aborted(exchange)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except QueueTimeoutError as exc:
            # Refused, not failed: dropped unserved after the tier's queue limit. Any of
            # the request's choices may be the one dropped; the others stop too.
            self._cancel_soon(exchange.job_ids)
            self._finish(exchange, f"rejected:{error_code(exc)}")
            if self.deps.admission is None:
                raise
            raise await self.deps.admission.queue_timeout_refusal(
                exc, plan.jobs[0], tier, headers
            ) from exc
        except Exception:
            # Answered with an error: the jobs must not run on for nobody.
            self._cancel_soon(exchange.job_ids)
            self._finish(exchange, "error")
            raise
        if options.stream:
            exchange.is_stream = True
            return StreamingResponse(
                self._stream(exchange, shape, first, outputs, options, plan),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", **headers},
                background=BackgroundTask(self._end_unbegun_stream, exchange, outputs),
            )
        self._finish(exchange, "ok")
        usage = Usage(exchange.num_prompt_tokens, exchange.num_completion_tokens)
        choices = [
            self.finished_choice(
                c,
                with_logprobs=options.logprobs is not None,
                chat=chat,
                echoed=plan.echoed_for(index),
            )
            for index, c in enumerate(collected)
        ]
        return JSONResponse(shape.full(choices, usage), headers=headers)

    def finished_choice(
        self,
        choice: CollectedChoice,
        *,
        with_logprobs: bool,
        chat: bool,
        echoed: EchoedPrompt | None = None,
    ) -> FinishedChoice:
        """A whole response's choice, with the echoed prompt before its text."""
        text = choice.text if echoed is None else echoed.text + choice.text
        logprobs = None
        if with_logprobs:
            prompt = None if echoed is None else (echoed, choice.prompt_logprobs or ())
            logprobs = self.logprobs_writer(chat=chat).body(choice.logprobs, echoed=prompt)
        return FinishedChoice(text, choice.finish_reason, logprobs)

    async def plan(
        self,
        parsed: CompletionRequest | ChatCompletionRequest,
        num_body_bytes: int,
        request_id: str,
        principal: Principal,
        tier: TierPolicy,
        arrival_s: float,
        *,
        chat: bool,
    ) -> RequestPlan:
        """The jobs a request runs as, one per (prompt, choice), each prompt tokenised,
        fitted to the context and given its sampling parameters; a typed 4xx if any
        cannot run."""
        options = parsed.options
        n = options.n
        num_prompts = 1 if isinstance(parsed, ChatCompletionRequest) else len(parsed.prompts)
        check_choices(n, tier, principal, num_prompts=num_prompts)
        prompts_ids = await self.prompt_token_ids_off_loop(parsed, num_body_bytes)
        jobs: list[Job] = []
        for i, prompt_ids in enumerate(prompts_ids):
            params = self.sampling_params(options, len(prompt_ids), chat=chat)
            job = build_job(request_id, principal, tier, prompt_ids, params, arrival_s, options)
            jobs.extend(choice_jobs(job, n, first_index=i * n))
        echoed = None
        if options.echo and isinstance(parsed, CompletionRequest):
            echoed = [
                await self.echoed_prompt(parsed, prompt, prompt_ids)
                for prompt, prompt_ids in zip(parsed.prompts, prompts_ids, strict=True)
            ]
        return RequestPlan(jobs, n, [len(ids) for ids in prompts_ids], echoed)

    async def echoed_prompt(
        self, parsed: CompletionRequest, prompt: Prompt, prompt_ids: list[int]
    ) -> EchoedPrompt:
        """What `echo` puts before each choice of `prompt`. Its offsets cost a few
        microseconds a token: a long prompt's are counted in a worker thread."""
        options = parsed.options
        text = prompt if isinstance(prompt, str) else None
        with_offsets = options.logprobs is not None
        args = (self.deps.model.tokenizer, prompt_ids, text)
        if not with_offsets or len(prompt_ids) < OFF_LOOP_MIN_ECHO_TOKENS:
            return echoed_prompt(*args, with_offsets=with_offsets)
        async with self._off_loop_slots:
            return await asyncio.to_thread(echoed_prompt, *args, with_offsets=True)

    async def _admit(
        self, exchange: Exchange, plan: RequestPlan, tier: TierPolicy, *, max_tokens_given: bool
    ) -> dict[str, str]:
        """Rate limits, SLO admission, enqueue of each choice's job; returns the
        x-ratelimit-* headers. One refusal refuses the request: choices already queued
        are cancelled."""
        admission = self.deps.admission
        jobs = plan.jobs
        if admission is None:
            await self._enqueue_all(exchange, jobs, self.deps.dispatcher.submit_and_wait)
            return {}
        reservation = await admission.reserve(
            exchange.principal,
            jobs[0],
            num_choices=len(jobs),
            num_prompts=len(plan.prompt_tokens),
            num_tokens=plan.num_reserved_tokens,
            max_tokens_given=max_tokens_given,
        )
        headers = reservation.status.headers()
        try:
            # The request's TTFT is its first choice's first token: SLO admission checks
            # that one. Checked too, each later choice would count the ones before it as
            # work ahead and refuse a request an idle fleet serves at once.
            await self._enqueue_all(
                exchange,
                jobs,
                lambda job: admission.enqueue(job, tier, headers=headers, check_slo=job is jobs[0]),
            )
        except BaseException:
            admission.release_soon(reservation, 0)
            raise
        exchange.reservation = reservation
        return headers

    async def _enqueue_all(
        self,
        exchange: Exchange,
        jobs: list[Job],
        enqueue: Callable[[Job], Awaitable[JobStream]],
    ) -> None:
        streams: list[JobStream] = []
        try:
            for job in jobs:
                streams.append(await enqueue(job))
        except BaseException:
            self._cancel_soon([stream.job.job_id for stream in streams])
            # Queued, they are the request's: its record (a refusal) settles them.
            exchange.streams = streams
            raise
        exchange.streams = streams

    def _cancel_soon(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.deps.dispatcher.cancel_soon(job_id)

    async def resolve_tier(self, principal: Principal, requested: str | None) -> TierPolicy:
        if requested is None or requested in OWN_TIER_ALIASES or requested == principal.tier.name:
            return principal.tier
        try:
            tier = await self.deps.tiers.get(requested)
        except NotFoundError:
            raise InvalidRequestError(
                f"Unknown service_tier {requested!r}.", param="service_tier"
            ) from None
        # Lower means a worse rank. Another tier of the key's own rank is not lower:
        # taken as lower, it let a tenant pick any price, SLO and share of its rank (an
        # admin-made tier with no prices billed it nothing).
        if tier.rank <= principal.tier.rank:
            raise PermissionDeniedError(
                f"service_tier {requested!r} is not below this key's tier "
                f"{principal.tier.name!r}; a request may only ask for a lower tier.",
                param="service_tier",
                code="tier_not_allowed",
            )
        return tier

    # resolve_tier, check_model, prompt_token_ids, sampling_params and build_job are the
    # endpoint's validation steps; the Batch API runs each batch line through the same ones.
    def check_model(self, model: str) -> None:
        """NotFoundError unless `model` is the model this server serves."""
        if model != self.deps.model.model_name:
            raise NotFoundError(
                f"The model {model!r} does not exist; this server serves "
                f"{self.deps.model.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    async def prompt_token_ids_off_loop(
        self, parsed: CompletionRequest | ChatCompletionRequest, num_body_bytes: int
    ) -> list[list[int]]:
        """prompt_token_ids, without stalling the event loop on a large prompt.

        A prompt longer in characters than the context can hold in tokens is refused
        unread. A large body is tokenized in a worker thread (long texts encode without
        the GIL; a template render yields it every switch interval), a few at a time, so
        one tenant's megabyte prompt does not freeze every other request.
        """
        self._refuse_unfittable(parsed)
        if num_body_bytes < OFF_LOOP_MIN_BODY_BYTES:
            return self.prompt_token_ids(parsed)
        async with self._off_loop_slots:
            return await asyncio.to_thread(self.prompt_token_ids, parsed)

    def _refuse_unfittable(self, parsed: CompletionRequest | ChatCompletionRequest) -> None:
        if isinstance(parsed, ChatCompletionRequest):
            self._refuse_too_many_messages(parsed)
            texts, param = [sum(len(m.content) for m in parsed.messages)], "messages"
        else:  # token ids: their count is known
            texts, param = [len(p) for p in parsed.prompts if isinstance(p, str)], "prompt"
        max_model_len = self.deps.model.max_model_len
        # Twice the bound: it only has to stop absurd inputs, never a prompt that fits.
        for num_chars in texts:
            if num_chars > 2 * max_model_len * self.deps.model.tokenizer.max_token_chars:
                raise PromptTooLongError(
                    num_chars=num_chars, max_model_len=max_model_len, param=param
                )

    def _refuse_too_many_messages(self, parsed: ChatCompletionRequest) -> None:
        """Empty messages have no characters, so the bound above lets any number of them
        through, yet each is rendered by the template and tokenized: a 4 MB body of
        140,000 took 5 s of CPU to be refused as too long, before any rate limit counted
        it. The template gives every message at least one token (its role), so more
        messages than twice the context cannot fit either."""
        max_model_len = self.deps.model.max_model_len
        if len(parsed.messages) > 2 * max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens; the "
                f"request has {len(parsed.messages)} messages, far more than that many "
                "tokens can hold.",
                param="messages",
                code="context_length_exceeded",
            )

    def prompt_token_ids(
        self, parsed: CompletionRequest | ChatCompletionRequest
    ) -> list[list[int]]:
        """Each prompt as token ids (chat: its one, template applied); a typed 400 if
        any is unusable."""
        tokenizer = self.deps.model.tokenizer
        if isinstance(parsed, ChatCompletionRequest):
            messages = [m.as_template_dict() for m in parsed.messages]
            return [list(tokenizer.apply_chat_template(messages))]
        return [self._completion_prompt_ids(prompt) for prompt in parsed.prompts]

    def _completion_prompt_ids(self, prompt: Prompt) -> list[int]:
        tokenizer = self.deps.model.tokenizer
        if isinstance(prompt, str):
            ids = list(tokenizer.encode(prompt))
        else:
            ids = list(prompt)
            vocab_size = tokenizer.vocab_size
            if any(t >= vocab_size for t in ids):
                raise InvalidRequestError(
                    f"Token ids must be below the vocabulary size {vocab_size}.", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
        return ids

    def sampling_params(
        self, options: GenerationOptions, num_prompt_tokens: int, *, chat: bool
    ) -> SamplingParams:
        max_model_len = self.deps.model.max_model_len
        max_tokens = options.max_tokens
        if max_tokens is None:
            # Chat defaults to the rest of the context window, as OpenAI does.
            remaining = max_model_len - num_prompt_tokens
            max_tokens = remaining if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, remaining)
            max_tokens = max(max_tokens, 1)
        if num_prompt_tokens + max_tokens > max_model_len:
            # The field to change: max_tokens if the client set it and the prompt leaves
            # room for a token, else the prompt.
            change_max_tokens = options.max_tokens is not None and num_prompt_tokens < max_model_len
            raise ContextLengthExceededError(
                num_prompt_tokens=num_prompt_tokens,
                max_tokens=max_tokens,
                max_model_len=max_model_len,
                param=options.max_tokens_param
                if change_max_tokens
                else ("messages" if chat else "prompt"),
            )
        if options.min_tokens > max_tokens:  # a client's max_tokens was checked already
            raise InvalidRequestError(
                f"min_tokens ({options.min_tokens}) must not exceed max_tokens, which "
                f"defaulted to {max_tokens}; set max_tokens.",
                param="min_tokens",
            )
        vocab_size = self.deps.model.tokenizer.vocab_size
        for param, tokens in (
            ("logit_bias", [token for token, _ in options.logit_bias]),
            ("stop_token_ids", options.stop_token_ids),
        ):
            for token in tokens:
                if token >= vocab_size:
                    raise InvalidRequestError(
                        f"{param} token id {token} is not below the vocabulary size {vocab_size}.",
                        param=param,
                    )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop=options.stop,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            logit_bias=options.logit_bias,
            top_k=options.top_k,
            stop_token_ids=options.stop_token_ids,
            ignore_eos=options.ignore_eos,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            min_tokens=options.min_tokens,
            logprobs=options.logprobs,
            # echo with logprobs reports the prompt tokens' too.
            prompt_logprobs=options.logprobs if options.echo else None,
        )

    async def _collect(
        self, exchange: Exchange, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> list[CollectedChoice]:
        choices = [CollectedChoice() for _ in exchange.choice_tokens]
        async for index, output in outputs:
            self._account(exchange, index, output)
            choice = choices[index]
            choice.pieces.append(output.text_delta)
            choice.logprobs.extend(output.new_logprobs)
            if output.prompt_logprobs is not None:
                choice.prompt_logprobs = output.prompt_logprobs
            if output.finished:
                choice.finish_reason = _finish_reason(output)
        return choices

    def logprobs_writer(self, *, chat: bool) -> LogprobsWriter:
        """A response's logprobs objects (the token texts are shared by every response)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.deps.model.tokenizer)
        return LogprobsWriter(self._token_texts, chat=chat)

    async def _stream(
        self,
        exchange: Exchange,
        shape: ResponseShape,
        first: tuple[int, Any] | None,
        outputs: AsyncGenerator[tuple[int, Any], None],
        options: GenerationOptions,
        plan: RequestPlan,
    ) -> AsyncIterator[bytes]:
        exchange.stream_began = True
        outcome = "aborted"
        include_usage = options.include_usage
        num_choices = len(exchange.choice_tokens)
        writers = [self._writer(options, chat=shape.chat) for _ in range(num_choices)]
        # Log-probabilities of tokens whose text is held back wait for the next chunk of
        # their choice.
        pending: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]
        # With echo, each choice's first chunk is the prompt, sent with its first output
        # (which brings the prompt's log-probabilities).
        to_echo = set(range(num_choices)) if plan.echoed is not None else set()
        try:
            if shape.chat:
                for index in range(num_choices):
                    yield shape.chunk(
                        "", None, index=index, first=True, include_usage=include_usage
                    )
            item = first
            while item is not None:
                index, output = item
                echoed = plan.echoed_for(index)
                if index in to_echo and echoed is not None:
                    to_echo.discard(index)
                    writer = writers[index]
                    prompt_logprobs = output.prompt_logprobs or ()
                    yield shape.chunk(
                        echoed.text,
                        None,
                        index=index,
                        include_usage=include_usage,
                        logprobs=writer and writer.prompt_body(echoed, prompt_logprobs),
                    )
                self._account(exchange, index, output, is_streamed=True)
                pending[index].extend(output.new_logprobs)
                finish_reason = _finish_reason(output) if output.finished else None
                if output.text_delta or finish_reason is not None:
                    if exchange.first_token_s is None:
                        # TTFT ends when the first token is sent: a token whose text is
                        # held back (part of a character, a possible stop string) is not.
                        exchange.first_token_s = time.monotonic()
                    writer = writers[index]
                    yield shape.chunk(
                        output.text_delta,
                        finish_reason,
                        index=index,
                        include_usage=include_usage,
                        logprobs=writer and writer.body(pending[index]),
                    )
                    pending[index] = []
                item = await _next_or_none(outputs)
            if include_usage:
                yield shape.usage_chunk(
                    Usage(exchange.num_prompt_tokens, exchange.num_completion_tokens)
                )
            yield SSE_DONE
            outcome = "ok"
        except RequestAbortedError:
            outcome = "aborted"
        except Exception as exc:
            # Headers are gone: the error travels as an SSE event, then the stream ends.
            outcome = "error"
            yield b"data: " + error_response(exc).body + b"\n\n"
        finally:
            # The server cancels this generator when the client goes away; the clean-up
            # must still run (jobs cancelled, reservation released), so it is shielded.
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # its readers stop now, not when collected
                if outcome == "aborted":
                    await self._cancel_quietly(exchange)
                elif outcome == "error":
                    # The error event is sent: the jobs must not run on for nobody. In
                    # the background, so a hung queue does not hold the stream's end.
                    self._cancel_soon(exchange.job_ids)
                self._finish(exchange, outcome)

    async def _end_unbegun_stream(
        self, exchange: Exchange, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> None:
        """A client that leaves right after the answer is decided can make the server drop
        the SSE body before it starts (its disconnect cancels the body's task): the body's
        own clean-up never runs, so the request ends here, as aborted."""
        if exchange.stream_began:
            return
        await outputs.aclose()
        await self._finish_aborted(exchange)

    def _writer(self, options: GenerationOptions, *, chat: bool) -> LogprobsWriter | None:
        return None if options.logprobs is None else self.logprobs_writer(chat=chat)

    def _account(
        self, exchange: Exchange, index: int, output: Any, *, is_streamed: bool = False
    ) -> None:
        """Counts and token times of one output of choice `index`; a stream marks its
        first token where it sends it (see _stream), a full response at the first token
        made."""
        if output.new_token_ids:
            exchange.last_token_s = time.monotonic()
            if exchange.first_token_s is None and not is_streamed:
                exchange.first_token_s = exchange.last_token_s
        exchange.choice_tokens[index] = output.num_output_tokens

    def _finish(self, exchange: Exchange, outcome: str) -> None:
        """Leave the request's usage record and report it to telemetry (once per request)."""
        record = exchange.record(outcome)
        if self.deps.admission is not None and exchange.reservation is not None:
            # As the usage report bills: nothing for a refusal (a queue timeout, even of
            # a request with choices that ran), no prompt never served (its client left
            # while it was queued).
            used = billed_tokens(
                outcome, record.queue_wait_ms, record.prompt_tokens, record.completion_tokens
            )
            self.deps.admission.release_soon(exchange.reservation, sum(used))
            exchange.reservation = None
        self.deps.usage.record(record)
        if self.deps.telemetry is not None:
            self.deps.telemetry.request_finished(record, exchange.timeline())

    async def _finish_aborted(self, exchange: Exchange) -> None:
        await self._cancel_quietly(exchange)
        self._finish(exchange, "aborted")

    async def _cancel_quietly(self, exchange: Exchange) -> None:
        """Cancel the jobs of a client that went away. Nobody is left to answer, so a
        queue that cannot be reached is logged (the dispatcher tries again later). A job
        a worker holds already has its prompt read (billed) though it sent no token:
        asked before the cancel, which ends the lease."""
        jobs = self.deps.dispatcher
        await asyncio.gather(*(jobs.note_lease(stream) for stream in exchange.streams))
        await asyncio.gather(*(self._cancel_job_quietly(job_id) for job_id in exchange.job_ids))

    async def _cancel_job_quietly(self, job_id: str) -> None:
        try:
            await self.deps.dispatcher.cancel(job_id)
        except Exception as exc:
            log.warning("request %s: could not cancel its job: %r", job_id, exc)

    async def _unless_disconnected(self, request: Request, work: Awaitable[T]) -> T:
        """Await work, but give up (ClientDisconnectedError) if the client disconnects.

        The work runs in this task and one watcher task cancels it on a disconnect: a
        second task per request, and asyncio.wait over both, cost more than the work."""
        current = asyncio.current_task()
        assert current is not None
        state = {"done": False, "disconnected": False}

        def on_disconnect(watch: asyncio.Task[None]) -> None:
            if state["done"] or watch.cancelled() or watch.exception() is not None:
                return
            state["disconnected"] = True
            current.cancel()

        watch = asyncio.create_task(_wait_disconnect(request))
        watch.add_done_callback(on_disconnect)
        try:
            return await work
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            current.uncancel()  # the cancellation was ours: it becomes the typed error
            raise ClientDisconnectedError() from None
        finally:
            state["done"] = True
            watch.cancel()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_or_none(outputs: AsyncIterator[Any]) -> Any:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None


def _finish_reason(output: Any) -> str | None:
    reason = output.finish_reason
    return None if reason is None else str(reason)
