"""The gateway's end of a job: enqueue it, then read its result channel as a stream.

A gateway never talks to an engine. It puts an admitted job on the shared queue
(`JobClient.submit`) and iterates the returned `JobStream`, which turns the job's result
events (published by whichever worker holds the job, possibly several in turn after a
worker died) into `StreamOutput`s. Cancelling the job (the client went away) removes it
from the queue, or makes its worker abort it at its next publish or heartbeat.

The first event a lease publishes carries the job's queue wait (ResultEvent.queue_wait_ms),
so the gateway learns when the job left the queue without an event, and a wake-up, of
its own; on a later event, from a lease that resumed the job after its worker died, it
says when the job's current run began (the pace of its stream counts from there).

Beside its streams, a JobClient keeps four things in the background (`_keep`, once a
second): its presence in the queue (`publish_gateway`), so that the jobs of a gateway
that died are abandoned instead of run for nobody; the cancels the queue could not take
when they were made (Redis unreachable), tried again until they land, so that a client
answered with an error does not leave its job to run once Redis is back; the jobs whose
usage records are written (`settle`), told to the queue so that no other gateway bills
them again should this one die; and a watch on the fleet: a request waiting for a worker
when none has been live for `no_worker_ms` is answered with NoCapacityError (503
no_capacity) and its job cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineDeadError, RequestAbortedError
from engine.request import TokenLogprob
from engine.stop_hazard import StopHazard, age_bucket, count_ages, new_step_counts
from scheduler.admission import NoCapacityError
from scheduler.backend import (
    GATEWAY_LOST,
    QUEUE_TIMEOUT,
    BackendUnavailableError,
    EventKind,
    JobStatus,
    QueueBackend,
    ResultEvent,
    SloBudget,
)
from scheduler.job import Job
from scheduler.logprobs import decode_logprobs

log = logging.getLogger(__name__)

# Codes a worker ends a stream with (ResultEvent.code).
ENGINE_ERROR = "engine_error"
INVALID_REQUEST = "invalid_request"
WORKER_SHUTDOWN = "worker_shutdown"

# The background round of a JobClient (presence, cancels to retry, the fleet watch).
KEEP_EVERY_S = 1.0
# A gateway's presence lapses this long after its last renewal (the queue then waits
# GATEWAY_GRACE_MS more before it abandons the gateway's jobs): a few missed rounds of
# an event loop that runs late, not the seconds a dead gateway's jobs would run on.
PRESENCE_TTL_MS = 5_000
# A cancel the queue could not take is tried again each round for this long, long
# enough to outlast a Redis restart or failover. A gateway that dies meanwhile needs it
# no more: its presence lapses and its jobs are abandoned.
CANCEL_RETRY_S = 600.0
MAX_PENDING_CANCELS = 100_000
# Settled jobs kept for the next round while the queue cannot be reached; past it the
# oldest are forgotten (should this gateway then die, the gateway that claims them finds
# their usage records written and bills nothing twice).
MAX_UNSETTLED = 100_000
# A request still waiting for a token after the fleet has shown no live worker for this
# long is answered 503 no_capacity. A worker's report lapses 5 s after its last
# heartbeat, so a client hears within about 5 s + this + a round that its worker died
# and none is left; a worker that comes back (a restart, a paused process) before then
# reclaims the job's expired lease and the request completes as if nothing happened.
NO_WORKER_MS = 5_000.0
# How long a closing client waits for the cancels it made in the background.
CLOSE_WAIT_S = 2.0


def process_instance_id() -> str:
    """host-pid-random: unique per process, and readable in Redis and /admin/v1/queues
    (a gateway's presence, a worker's id)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class QueueTimeoutError(Exception):
    """The job waited in the queue longer than its tier's max_queue_ms and was dropped."""

    def __init__(self, job_id: str, max_queue_ms: float | None) -> None:
        super().__init__(
            f"request {job_id} waited longer than the tier's queue limit "
            f"({max_queue_ms or 0:.0f} ms) and was dropped; retry later"
        )
        self.job_id = job_id
        self.max_queue_ms = max_queue_ms


class JobFailedError(Exception):
    """A worker ended the job with an error (code says which, message says why)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message or code


class JobInvalidError(JobFailedError):
    """The engine refused the job's parameters (a worker saw what the gateway missed)."""


@dataclass(frozen=True)
class StreamOutput:
    """One step of a job as the gateway sees it (the fields of engine RequestOutput the
    routes read): this event's tokens and text, and the running counts."""

    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # The new tokens' log-probabilities, for a job that asked for them.
    new_logprobs: tuple[TokenLogprob, ...] = ()
    # The prompt's (from its second token on), in the first output of a job that asked.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


_END = object()
# How long a stopped reader gets to end before it is cancelled again (see _stop).
RECANCEL_S = 0.05


async def _cancel_until_done(task: asyncio.Task[Any]) -> None:
    """Cancel `task` until it has ended. redis-py swallows a cancellation that lands
    while it opens a connection or sends a command, and a reader of a job that was
    cancelled while queued would then block on its stream forever (no event comes):
    the handler waiting for it never returned and a SIGTERM hung on it."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)


class JobStream:
    """The caller's end of one queued job; iterate it for StreamOutputs.

    Iteration ends after the finished output; raises QueueTimeoutError if the queue
    dropped the job, JobFailedError if its worker failed it, RequestAbortedError if it
    was cancelled, and the backend's error (BackendUnavailableError) if the queue
    cannot be read.
    """

    def __init__(self, job: Job, enqueued_s: float) -> None:
        self.job = job
        self.enqueued_s = enqueued_s  # monotonic
        # Monotonic: when the job left the queue, known from the first event (its
        # queue_wait_ms, else the event's arrival).
        self.dispatched_s: float | None = None
        self.num_output_tokens = 0
        # Its current run (_pace_s): when its lease began (monotonic) and the tokens
        # streamed before. A job resumed on another worker (its own died or handed it
        # back) begins a new run, whose lease's first event brings its queue wait too:
        # the seconds the stream stood still in between are no part of its pace.
        self.run_started_s: float | None = None
        self.run_base_tokens = 0
        # Monotonic: the last sign of life of the job (its enqueue, then each event).
        self.last_event_s = enqueued_s
        # A client waits on it: answered no_capacity when no worker is left to serve it
        # (a Batch API line waits for one instead).
        self.needs_worker = False
        # Called once with the finish reason when the job has finished.
        self.on_finished: Callable[[JobStream, str | None], None] | None = None
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        # The queue-timeout check: a timer while waiting, a task once it fires.
        self._watchdog: asyncio.TimerHandle | asyncio.Task[None] | None = None
        self._stopper: asyncio.Future[None] | None = None
        self._ended = False

    @property
    def queue_wait_ms(self) -> float | None:
        if self.dispatched_s is None:
            return None
        return (self.dispatched_s - self.enqueued_s) * 1000.0

    @property
    def is_dispatched(self) -> bool:
        return self.dispatched_s is not None

    def _start(self, events: AsyncIterator[ResultEvent]) -> None:
        self._reader = asyncio.create_task(self._read(events), name=f"results-{self.job.job_id}")

    async def _read(self, events: AsyncIterator[ResultEvent]) -> None:
        try:
            async for event in events:
                previous_s, self.last_event_s = self.last_event_s, time.monotonic()
                if event.kind is EventKind.TOKENS:
                    self._leased(event, previous_s)
                    self.num_output_tokens += len(event.token_ids)
                    self._put(self._output(event, finished=False))
                elif event.kind is EventKind.DONE:
                    self._leased(event, previous_s)
                    self._put(self._output(event, finished=True))
                    self._end(None)
                    if self.on_finished is not None:
                        self.on_finished(self, event.finish_reason)
                    return
                else:
                    self._end(self._error(event))
                    return
            self._end(RequestAbortedError(f"request {self.job.job_id} ended without a result"))
        except asyncio.CancelledError:
            self._end(RequestAbortedError(f"request {self.job.job_id} was cancelled"))
            raise
        except Exception as exc:
            self._end(exc)

    def _leased(self, event: ResultEvent, previous_s: float) -> None:
        """Note the lease an event shows begun: the job's first (its dispatch), or one
        that resumes it (a later event with a queue wait) and begins a new run."""
        if self.dispatched_s is None:
            self.dispatched_s = self._lease_began_s(event, self.enqueued_s)
            self.run_started_s = self.dispatched_s
        elif event.queue_wait_ms is not None:
            # Not before the event ahead of it: the earlier lease was still on then.
            self.run_started_s = self._lease_began_s(event, previous_s)
            self.run_base_tokens = self.num_output_tokens

    def _lease_began_s(self, event: ResultEvent, not_before_s: float) -> float:
        now_s = time.monotonic()
        if event.queue_wait_ms is None:
            return now_s
        # The worker measured from the job's arrival_s on its own clock: kept between
        # `not_before_s` and now, whatever the two hosts' clocks say.
        began_s = self.enqueued_s + event.queue_wait_ms / 1000.0
        return min(now_s, max(not_before_s, began_s))

    def _output(self, event: ResultEvent, *, finished: bool) -> StreamOutput:
        logprobs, prompt_logprobs = decode_logprobs(event.logprobs)
        return StreamOutput(
            new_token_ids=event.token_ids,
            text_delta=event.text,
            finished=finished,
            finish_reason=event.finish_reason or None if finished else None,
            num_prompt_tokens=self.job.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _error(self, event: ResultEvent) -> BaseException:
        if event.code == QUEUE_TIMEOUT:
            return QueueTimeoutError(self.job.job_id, self.job.max_queue_ms)
        if event.code == INVALID_REQUEST:
            return JobInvalidError(event.code, event.message)
        if event.code in (WORKER_SHUTDOWN, GATEWAY_LOST):
            # Lost with its gateway: only a gateway cut off from the queue for seconds
            # reads this; the request is gone, so it gets the retry of a shutdown.
            return EngineDeadError(event.message or "the worker shut down")
        return JobFailedError(event.code or ENGINE_ERROR, event.message)

    def _put(self, output: StreamOutput) -> None:
        self._items.put_nowait(output)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._items.put_nowait(_END if error is None else error)
            watchdog = self._watchdog
            if watchdog is not None and watchdog is not asyncio.current_task():
                watchdog.cancel()

    async def _stop(self, error: BaseException) -> None:
        """End the stream with `error` and wait until its reader has stopped. The reader
        is stopped even if the caller is cancelled meanwhile (and the caller's own
        cancellation is not swallowed)."""
        self._end(error)
        reader = self._reader
        if reader is None or reader.done():
            return
        if self._stopper is None:
            self._stopper = asyncio.ensure_future(_cancel_until_done(reader))
        await asyncio.shield(self._stopper)

    def __aiter__(self) -> AsyncIterator[StreamOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamOutput]:
        while True:
            item = await self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


# A stream's pace counts once it has made this many tokens: its first steps run behind
# prefills, and a pace from two tokens told a wait twenty times too long.
MIN_PACE_TOKENS = 8


def _pace_s(stream: JobStream) -> float | None:
    """Seconds per token a stream has gone at since its current run's lease began (its
    dispatch, or the lease that resumed it after its worker died)."""
    made = stream.num_output_tokens - stream.run_base_tokens
    if stream.run_started_s is None or made < MIN_PACE_TOKENS:
        return None
    pace = (stream.last_event_s - stream.run_started_s) / made
    return pace if pace > 0 else None


class JobClient:
    """Submits jobs to the queue and follows their result channels (the gateway side).

    `on_enqueue` is called after each successful enqueue: a worker in the same process
    uses it to look at the queue at once instead of at its next poll. Every job is
    queued under `gateway_id`, this client's presence (see the module docstring).
    """

    def __init__(
        self,
        backend: QueueBackend,
        *,
        poll_ms: int = 500,
        on_enqueue: Callable[[], None] | None = None,
        gateway_id: str | None = None,
        keep_every_s: float = KEEP_EVERY_S,
        presence_ttl_ms: int = PRESENCE_TTL_MS,
        no_worker_ms: float = NO_WORKER_MS,
        cancel_retry_s: float = CANCEL_RETRY_S,
    ) -> None:
        if presence_ttl_ms <= 2 * keep_every_s * 1000:
            raise ValueError("the presence must outlast two rounds of its renewal")
        self._backend = backend
        self._poll_ms = poll_ms
        self._on_enqueue = on_enqueue
        self.gateway_id = gateway_id or process_instance_id()
        self._keep_every_s = keep_every_s
        self._presence_ttl_ms = presence_ttl_ms
        self._no_worker_s = no_worker_ms / 1000.0
        self._cancel_retry_s = cancel_retry_s
        self._streams: dict[str, JobStream] = {}
        self._closed = False
        # The background loops (see `_start_keeper`); empty until the first job.
        self._keepers: list[asyncio.Task[None]] = []
        # job id -> monotonic time after which its cancel is no longer retried
        self._pending_cancels: dict[str, float] = {}
        self._unsettled: deque[str] = deque(maxlen=MAX_UNSETTLED)
        self._no_worker_since: float | None = None  # monotonic; None while one is live
        self._background: set[asyncio.Task[Any]] = set()
        # How the jobs that finished here stopped, by age (the stop curve of the waits
        # at a tenant's concurrency cap: gateway.concurrency_wait).
        self.stop_hazard = StopHazard()

    @property
    def backend(self) -> QueueBackend:
        return self._backend

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_pending_cancels(self) -> int:
        """Cancels the queue could not take yet (tried again every round)."""
        return len(self._pending_cancels)

    async def submit_and_wait(
        self, job: Job, *, queue_timeout_ms: float | None = None, slo: SloBudget | None = None
    ) -> JobStream:
        """Enqueue the job and return the stream of its results. The queue's refusals
        raise here: QueueFullError, UnknownTierError, BackendUnavailableError, and with
        an `slo` budget SloUnattainableError (see QueueBackend.enqueue).

        With `queue_timeout_ms`, a job still queued after that long is dropped and its
        stream raises QueueTimeoutError (the queue also drops timed-out jobs, but only
        when a worker asks it for work, which a busy fleet may not do for a while). A
        client waits on it: when no worker has been live for `no_worker_ms` and the job
        has had no event meanwhile, its stream raises NoCapacityError and it is
        cancelled.
        """
        stream = self._open(job)
        stream.needs_worker = True
        try:
            await self._backend.enqueue(job, slo=slo, gateway_id=self.gateway_id)
        except BaseException:
            self._streams.pop(job.job_id, None)
            raise
        stream._start(self._follow(job.job_id))
        if queue_timeout_ms is not None:
            # A timer, not a sleeping task: nearly every job leaves the queue in time, and
            # a timer costs a fraction of a task to set up and to cancel.
            stream._watchdog = asyncio.get_running_loop().call_later(
                queue_timeout_ms / 1000.0, self._start_expiry, stream, queue_timeout_ms
            )
        if self._on_enqueue is not None:
            self._on_enqueue()
        return stream

    def _start_expiry(self, stream: JobStream, timeout_ms: float) -> None:
        if not stream._ended:
            stream._watchdog = asyncio.create_task(self._expire(stream, timeout_ms))

    async def _expire(self, stream: JobStream, timeout_ms: float) -> None:
        job_id = stream.job.job_id
        if stream.is_dispatched or stream._ended:
            return
        with contextlib.suppress(Exception):
            if await self._backend.job_status(job_id) is not JobStatus.QUEUED:
                return
            if await self._backend.cancel(job_id):
                self._streams.pop(job_id, None)
                await stream._stop(QueueTimeoutError(job_id, stream.job.max_queue_ms))

    def submit(self, job: Job) -> JobStream:
        """Enqueue the job in the background and return its stream at once; a refusal
        of the queue raises from the stream's iteration."""
        stream = self._open(job)
        stream._start(self._enqueue_then_follow(job))
        return stream

    def _open(self, job: Job) -> JobStream:
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        self._start_keeper()
        stream = JobStream(job, time.monotonic())
        stream.on_finished = self._learn_stop
        self._streams[job.job_id] = stream
        return stream

    def _learn_stop(self, stream: JobStream, finish_reason: str | None) -> None:
        """Count a finished job's tokens by age, and its stop if it stopped before its
        max_tokens, as an engine counts its requests' (engine.stop_hazard)."""
        num_tokens = stream.num_output_tokens
        if num_tokens <= 0 or not stream.job.params.can_stop_early:
            return
        tokens, stops = new_step_counts(), new_step_counts()
        count_ages(tokens, 0, num_tokens)
        if finish_reason == "stop":
            stops[age_bucket(num_tokens - 1)] += 1
        self.stop_hazard.record(tokens, stops)

    def stream_pace_s(self) -> float | None:
        """Seconds per token of the jobs streaming through this client (the median of
        those that have streamed enough to tell); None when none has."""
        paces = [p for s in self._streams.values() if (p := _pace_s(s)) is not None]
        return statistics.median(paces) if paces else None

    async def _enqueue_then_follow(self, job: Job) -> AsyncIterator[ResultEvent]:
        try:
            await self._backend.enqueue(job, gateway_id=self.gateway_id)
        except BaseException:
            self._streams.pop(job.job_id, None)
            raise
        if self._on_enqueue is not None:
            self._on_enqueue()
        async for event in self._follow(job.job_id):
            yield event

    async def _follow(self, job_id: str) -> AsyncIterator[ResultEvent]:
        try:
            async for event in self._backend.results(job_id, poll_ms=self._poll_ms):
                yield event
        finally:
            self._streams.pop(job_id, None)

    async def cancel(self, job_id: str) -> bool:
        """Drop the job from the queue, or have its worker abort it. Idempotent; True if
        the queue still held the job (queued or running). A queue that cannot be reached
        raises BackendUnavailableError, and the cancel is tried again every round until
        it lands (for `cancel_retry_s` at most): the job must not run for nobody once the
        queue is back."""
        stream = self._streams.pop(job_id, None)
        try:
            cancelled = await self._backend.cancel(job_id)
        except BackendUnavailableError:
            self._retry_cancel(job_id)
            raise
        finally:
            if stream is not None:
                await stream._stop(RequestAbortedError(f"request {job_id} was cancelled"))
        return cancelled

    async def note_lease(self, stream: JobStream) -> None:
        """For a job about to be cancelled before any event came: if a worker holds it,
        its prompt is being read (prefill), so it is marked dispatched now (its queue
        wait was at most that). A queue that cannot be read leaves it as it was."""
        if stream.is_dispatched:
            return
        with contextlib.suppress(BackendUnavailableError):
            if await self._backend.job_status(stream.job.job_id) is JobStatus.LEASED:
                stream.dispatched_s = stream.run_started_s = time.monotonic()

    def cancel_soon(self, job_id: str) -> None:
        """`cancel` in the background, for a caller that answers its client first (a
        queue that hangs would hold the answer for its whole timeout)."""
        if self._closed:
            return  # aclose cancels every job it still follows
        task = asyncio.create_task(self._cancel_quietly(job_id), name=f"cancel-{job_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_quietly(self, job_id: str) -> None:
        try:
            await self.cancel(job_id)
        except BackendUnavailableError as exc:
            log.warning("request %s: cancel deferred, the queue is unreachable (%s)", job_id, exc)
        except Exception:
            log.exception("request %s: could not cancel its job", job_id)

    async def claimed_elsewhere(self, job_ids: list[str]) -> set[str]:
        """Those of these jobs (about to be billed) that another gateway has billed:
        this one looked gone long enough (stopped, or cut off from Redis) for it to
        claim them (QueueBackend.claim_unbilled). The presence is renewed first, so
        that no claim can start after this answer while the caller writes its records.
        A queue that cannot be reached claims nothing meanwhile: none then."""
        try:
            await self._publish_presence()
            return await self._backend.claimed_elsewhere(job_ids)
        except BackendUnavailableError:
            return set()

    def settle(self, job_ids: Iterable[str]) -> None:
        """These jobs' usage is written: the queue is told at the next round (see
        QueueBackend.settle). Never blocks and never raises."""
        self._unsettled.extend(job_ids)

    async def _settle_billed(self) -> None:
        if not self._unsettled:
            return
        batch, self._unsettled = self._unsettled, deque(maxlen=MAX_UNSETTLED)
        try:
            await self._backend.settle(self.gateway_id, list(batch))
        except BaseException:
            batch.extend(self._unsettled)  # in order; past the cap the oldest go
            self._unsettled = batch
            raise

    def _retry_cancel(self, job_id: str) -> None:
        if self._closed:
            return  # aclose tries the pending ones a last time; later ones lapse with us
        if job_id not in self._pending_cancels:
            if len(self._pending_cancels) >= MAX_PENDING_CANCELS:
                oldest = next(iter(self._pending_cancels))
                del self._pending_cancels[oldest]
                log.warning("request %s: too many cancels pending, gave up on it", oldest)
            self._pending_cancels[job_id] = time.monotonic() + self._cancel_retry_s
        self._start_keeper()

    # ----------------------------------------------------------------- background
    def _start_keeper(self) -> None:
        # The presence has a loop of its own: retries piling up after an outage, or a
        # stream the watch stops, must not hold back its renewal past the queue's grace.
        # Started by the first job, they run in a context of their own: in the request's,
        # every line they logged ("its deferred cancel landed") carried that request's id.
        if not self._keepers and not self._closed:
            self._keepers = [
                asyncio.create_task(
                    self._keep(self._publish_presence),
                    name="gateway-presence",
                    context=contextvars.Context(),
                ),
                asyncio.create_task(
                    self._keep(self._retry_cancels, self._settle_billed, self._watch_workers),
                    name="job-client-watch",
                    context=contextvars.Context(),
                ),
            ]

    async def _keep(self, *steps: Callable[[], Any]) -> None:
        while True:
            for step in steps:
                try:
                    await step()
                except BackendUnavailableError as exc:
                    log.debug("%s: %s", step.__name__, exc)
                except Exception:
                    log.exception("%s failed", step.__name__)
            await asyncio.sleep(self._keep_every_s)

    async def _publish_presence(self) -> None:
        await self._backend.publish_gateway(self.gateway_id, self._presence_ttl_ms)

    async def _retry_cancels(self) -> None:
        now_s = time.monotonic()
        for job_id, until_s in list(self._pending_cancels.items()):
            if now_s > until_s:
                del self._pending_cancels[job_id]
                log.warning("request %s: gave up cancelling its job", job_id)
                continue
            await self._backend.cancel(job_id)  # unreachable still: the next round
            self._pending_cancels.pop(job_id, None)
            log.info("request %s: its deferred cancel landed", job_id)

    async def _watch_workers(self) -> None:
        """Answer the requests nothing can serve: no worker live for `no_worker_ms`.

        Why here, and not by reclaiming the expired leases from the gateway: a job put
        back in a queue that no worker reads waits just the same, and a job that already
        ran has no queue timeout to fall back on (its client has tokens), nor has any
        job of a tier without max_queue_ms. What its client needs to hear is what a new
        request hears at once with no live worker: 503 no_capacity. A gap in the
        reports shorter than the grace (a restarting or paused worker) changes nothing.
        """
        waiting = [s for s in self._streams.values() if s.needs_worker and not s._ended]
        if not waiting:
            self._no_worker_since = None
            return
        capacity = await self._backend.fleet_capacity()
        now_s = time.monotonic()
        if capacity.num_workers:
            self._no_worker_since = None
            return
        if self._no_worker_since is None:
            self._no_worker_since = now_s
        for stream in waiting:
            if now_s - max(self._no_worker_since, stream.last_event_s) >= self._no_worker_s:
                await self._fail_without_workers(stream)

    async def _fail_without_workers(self, stream: JobStream) -> None:
        job_id = stream.job.job_id
        self._streams.pop(job_id, None)
        await stream._stop(
            NoCapacityError(
                f"No worker has been live for {self._no_worker_s:.0f} s, so nothing can "
                "serve this request; retry later."
            )
        )
        self.cancel_soon(job_id)

    async def aclose(self) -> None:
        """Cancel every open job; their streams raise EngineDeadError (shutting down)."""
        self._closed = True
        for job_id, stream in list(self._streams.items()):
            self._streams.pop(job_id, None)
            await stream._stop(EngineDeadError("the server is shutting down"))
            with contextlib.suppress(Exception):
                await self._backend.cancel(job_id)
        if self._background:
            # Cancels on their way: given a moment to land, not a hung queue's timeout.
            _, stuck = await asyncio.wait(list(self._background), timeout=CLOSE_WAIT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        keepers, self._keepers = self._keepers, []
        if not keepers:
            return  # never queued anything: no presence to lapse
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._retry_cancels()  # a last try; what is left lapses with us
        with contextlib.suppress(Exception):
            await self._settle_billed()
        with contextlib.suppress(Exception):
            # Lapse now rather than after the TTL: what is still queued goes at once.
            await self._backend.publish_gateway(self.gateway_id, 1)
