"""Feeds jobs from the shared queue to a local engine and publishes their results.

A worker (or the one-process `serve`) runs one Dispatcher next to its engine. It leases
jobs from the queue only when the engine says it can take more, as many in one call as
the engine has room for newcomers (`newcomer_room`, when the engine offers it), so the
queue (not the engine's waiting list) holds the backlog and decides the
order. Each job runs with its tier's rank and preemptibility, so the engine preempts
worse-rank work for a better rank arrival. Tokens go to the job's result channel as they
are generated and are charged to the tenant's fair-share counter; the job ends with
complete or fail.

In the background the dispatcher renews its leases (a job whose lease it lost, because
the client cancelled, its gateway went away or another worker reclaimed it, is aborted
in the engine), requeues the jobs of dead workers (`reclaim_expired_leases`) and
publishes its measured capacity, which keeps it counted as live. A job that resumes
after another worker died runs with its prompt plus the tokens the client already has
and continues after them.

`aclose` drains: it stops leasing, lets running jobs finish for a while, then puts the
rest back in the queue (each resumes elsewhere after the tokens it streamed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.errors import EngineDeadError, InvalidRequestError
from engine.request import Priority, SamplingParams, TokenLogprob
from scheduler.backend import WORKER_DETAIL_TYPES, BackendUnavailableError, QueueBackend
from scheduler.job import Job
from scheduler.logprobs import encode_logprobs
from scheduler.results import ENGINE_ERROR, INVALID_REQUEST, process_instance_id
from scheduler.slot_release import release_times_ms

log = logging.getLogger(__name__)

# How many ended jobs a dispatcher remembers (a job comes back within a lease or two).
ENDED_JOBS_REMEMBERED = 4096


class EngineLike(Protocol):
    """What the dispatcher needs from `engine.async_engine.AsyncEngine`."""

    def can_accept(self, rank: int | None = None) -> bool: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        priority: Priority,
        resumed_token_ids: tuple[int, ...] = (),
    ) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> Any: ...

    # Optional: `generate_batches`, the same outputs gathered into lists (AsyncEngine has
    # it); without it the dispatcher gathers them with a task of its own (_batches). And
    # `newcomer_room`: without it the dispatcher leases one job at a time.


@dataclass(frozen=True)
class DispatcherConfig:
    """Timings of one dispatcher.

    Until the engine has measured its rates, it reports the `default_*` ones, so that
    admission has a (rough) capacity to predict with from the first request on.
    """

    lease_ms: int = 10_000
    heartbeat_ms: int = 1_000  # renew leases, reclaim dead workers' jobs, report capacity
    capacity_ttl_ms: int = 5_000  # a worker silent this long no longer counts as live
    idle_poll_ms: float = 10.0  # an empty queue is looked at again after this
    full_poll_ms: float = 2.0  # a full engine is asked again after this (or a step)
    rank_check_ms: float = 50.0  # how often a full engine looks for better-rank work
    max_jobs_per_lease: int = 64  # jobs leased in one call, when the engine has room for them
    default_prefill_tokens_per_s: float = 2_000.0
    default_decode_tokens_per_s: float = 200.0
    drain_timeout_s: float = 30.0
    # When slots free, as reported for SLO admission (scheduler.slot_release): None, the
    # expected times; q in (0, 1), the times by which they have freed with probability q.
    slot_wait_quantile: float | None = None

    def __post_init__(self) -> None:
        if self.slot_wait_quantile is not None and not 0 < self.slot_wait_quantile < 1:
            raise ValueError("slot_wait_quantile must be between 0 and 1")
        if self.heartbeat_ms * 2 > self.lease_ms:
            raise ValueError("heartbeat_ms must be at most half of lease_ms")
        if self.capacity_ttl_ms <= self.heartbeat_ms:
            raise ValueError("capacity_ttl_ms must exceed heartbeat_ms")


@dataclass
class _Running:
    job: Job
    # The job's id in the engine: the job id (which is the client's x-request-id), except
    # for a job this worker ran before. That run's id may still be held (the engine drops
    # an aborted request only between two steps), and the new run would fail as a
    # duplicate.
    engine_request_id: str
    # Sent with the lease's first event, then None: the job's wait from its arrival at
    # the gateway to this lease (wall clocks of the two hosts).
    queue_wait_ms: float | None = None
    task: asyncio.Task[None] | None = None
    # Set by a drain: hand the job back at the next token. Cancelling the task alone is
    # not enough: a cancellation that lands inside a Redis call may be absorbed there.
    is_handed_back: bool = False


class _HandBack(Exception):
    """Internal: stop running this job here and requeue it."""


class Dispatcher:
    """Moves jobs from a QueueBackend into an engine as capacity allows."""

    def __init__(
        self,
        backend: QueueBackend,
        engine: EngineLike,
        *,
        worker_id: str | None = None,
        config: DispatcherConfig | None = None,
    ) -> None:
        self._backend = backend
        self._engine = engine
        self.worker_id = worker_id or process_instance_id()
        self._config = config or DispatcherConfig()
        self._running: dict[str, _Running] = {}
        # Jobs whose run here ended lately, oldest first (see _Running.engine_request_id).
        self._ended_here: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._wake = asyncio.Event()
        self._capacity_freed = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._is_stopping = False
        self._best_rank: int | None = None
        self._best_rank_at_s = 0.0
        self.num_dispatched = 0
        self._report_task: asyncio.Task[None] | None = None
        self._report_again = False

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def notify(self) -> None:
        """Something was queued: look at the queue now rather than at the next poll."""
        self._wake.set()

    def start(self) -> None:
        """Start leasing and heartbeating (idempotent)."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="dispatcher")
            self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")

    async def aclose(self, drain_timeout_s: float | None = None) -> None:
        """Stop leasing; give running jobs `drain_timeout_s` to finish, then requeue the
        rest (they resume on another worker after the tokens already streamed)."""
        timeout_s = self._config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self._is_stopping = True
        self._wake.set()
        for task in (self._loop_task,):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        tasks = [r.task for r in self._running.values() if r.task is not None]
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)
        for running in list(self._running.values()):
            running.is_handed_back = True
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in (self._heartbeat_task, self._report_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Lapse at once instead of after capacity_ttl_ms: admission stops counting us.
        with contextlib.suppress(Exception):
            await self._backend.publish_capacity(
                self.worker_id, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0, ttl_ms=1
            )

    async def publish_capacity(self) -> None:
        """Report the engine's measured rates (or the defaults until it has measured),
        the work it holds per rank, which admission adds to the queued work ahead, the
        requests it would start at its next step, and when its running requests are
        expected to free their slots."""
        stats = getattr(self._engine, "stats", None)
        prefill = decode = 0.0
        snapshot = None
        if callable(stats):
            snapshot = stats()
            prefill = float(getattr(snapshot, "prefill_tokens_per_s", 0.0))
            decode = float(getattr(snapshot, "decode_tokens_per_s", 0.0))
        prefill = prefill or self._config.default_prefill_tokens_per_s
        decode = decode or self._config.default_decode_tokens_per_s
        await self._backend.publish_capacity(
            self.worker_id,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            ttl_ms=self._config.capacity_ttl_ms,
            unprefilled_tokens_by_rank=getattr(snapshot, "unprefilled_tokens_by_rank", None),
            decode_tokens_by_rank=getattr(snapshot, "decode_tokens_by_rank", None),
            num_free_seqs=self._num_free_seqs(),
            release_ms=release_times_ms(
                getattr(snapshot, "running_left", ()),
                getattr(snapshot, "stop_curve", None),
                getattr(snapshot, "num_running", 0),
                decode,
                quantile=self._config.slot_wait_quantile,
            ),
            preemptible_by_rank=getattr(snapshot, "preemptible_by_rank", None),
            waiting_by_rank=getattr(snapshot, "waiting_by_rank", None),
            **{name: getattr(snapshot, name, None) for name in WORKER_DETAIL_TYPES},
        )

    def _num_free_seqs(self) -> int:
        """Requests the engine would start at its next step (0 when it cannot say)."""
        room = getattr(self._engine, "newcomer_room", None)
        if self._is_stopping or not callable(room):
            return 0
        num_seqs, num_tokens = room()
        return num_seqs if num_tokens > 0 else 0

    def _report_capacity_soon(self) -> None:
        """Report the engine's held work now rather than at the next heartbeat: a job left
        the engine before using all its max_tokens. Admission adds the reported backlog
        to the work ahead of each request, and a finished job's unused tokens counted
        there for up to a heartbeat: a client sending one request after another to an
        idle server was refused as SLO-unattainable. One report at a time; jobs that end
        while one is on its way get one more after it."""
        if self._is_stopping:
            return
        if self._report_task is not None and not self._report_task.done():
            self._report_again = True
            return
        self._report_task = asyncio.create_task(self._report_capacity(), name="capacity-report")

    async def _report_capacity(self) -> None:
        while True:
            self._report_again = False
            try:
                await self.publish_capacity()
            except BackendUnavailableError:
                return  # the heartbeat reports (and logs) when the queue is back
            except Exception:
                log.exception("capacity report failed")
                return
            if not self._report_again:
                return

    # ----------------------------------------------------------------- leasing
    async def _run(self) -> None:
        config = self._config
        while not self._is_stopping:
            if not await self._engine_can_take():
                await _wait(self._capacity_freed, config.full_poll_ms)
                continue
            self._wake.clear()
            num_wanted = self._num_to_lease()
            try:
                jobs = await self._lease(num_wanted)
            except BackendUnavailableError as exc:
                log.warning("cannot lease work: %s", exc)
                await asyncio.sleep(0.5)
                continue
            leased_s = time.time()
            for job in jobs:
                self.num_dispatched += 1
                if job.job_id in self._running:
                    # Its lease lapsed (another worker's clock ran ahead, or this one
                    # stalled) and came back here while its run goes on: that run holds
                    # the job again and continues from where it is, the only publisher
                    # of its stream. A second run would resume after the tokens of the
                    # lease, miss those the first publishes meanwhile and repeat them.
                    log.info("job %s was leased again by its own worker", job.job_id)
                    continue
                running = _Running(
                    job,
                    self._engine_request_id(job.job_id),
                    max(0.0, (leased_s - job.arrival_s) * 1000.0),
                )
                running.task = asyncio.create_task(self._drive(running), name=f"job-{job.job_id}")
                self._running[job.job_id] = running
            if len(jobs) < num_wanted:
                # The queue ran dry: asking again at once would only find it empty.
                await _wait(self._wake, config.idle_poll_ms)
                continue
            # Let the jobs reach the engine before asking it about capacity again.
            await asyncio.sleep(0)

    def _num_to_lease(self) -> int:
        """As many jobs as the engine has room for newcomers (one when it only takes a
        better rank's work, or cannot say), up to max_jobs_per_lease."""
        room = getattr(self._engine, "newcomer_room", None)
        if not callable(room):
            return 1
        num_seqs, _ = room()
        return max(1, min(num_seqs, self._config.max_jobs_per_lease))

    async def _lease(self, num_jobs: int) -> list[Job]:
        """Up to `num_jobs` jobs in policy order, in one call to the queue."""
        lease_ms = self._config.lease_ms
        if num_jobs > 1:
            return await self._backend.dispatch_many(self.worker_id, lease_ms, num_jobs)
        job = await self._backend.dispatch(self.worker_id, lease_ms)
        return [] if job is None else [job]

    async def _engine_can_take(self) -> bool:
        if self._engine.can_accept():
            return True
        # Full: still take work of a rank that would preempt worse, preemptible work.
        now_s = time.monotonic()
        if now_s - self._best_rank_at_s >= self._config.rank_check_ms / 1000.0:
            self._best_rank_at_s = now_s
            self._best_rank = await self._best_queued_rank()
        if self._best_rank is None or not self._engine.can_accept(self._best_rank):
            return False
        # One job, the queue's best: the best rank is read again before the next. Kept,
        # the rank the job was leased for let the jobs of worse ranks queued behind it
        # follow it into the full engine, one per step, and wait there.
        self._best_rank_at_s = -math.inf
        return True

    def _engine_request_id(self, job_id: str) -> str:
        if job_id in self._ended_here:
            return f"{job_id}#{self.num_dispatched}"
        return job_id

    def _ended(self, job_id: str) -> None:
        self._running.pop(job_id, None)
        self._ended_here[job_id] = None
        if len(self._ended_here) > ENDED_JOBS_REMEMBERED:
            self._ended_here.popitem(last=False)

    async def _best_queued_rank(self) -> int | None:
        try:
            depth = await self._backend.depth()
            if not depth:
                return None
            ranks = {t.name: t.rank for t in await self._backend.get_tiers()}
        except BackendUnavailableError:
            return None
        known = [ranks[name] for name in depth if name in ranks]
        return min(known) if known else None

    async def _drive(self, running: _Running) -> None:
        job, backend, worker = running.job, self._backend, self.worker_id
        # Whether what the engine held for it is accounted for: it used all its
        # max_tokens (nothing left over), or its end was reported already.
        reported = False
        # Every publish below checks this worker still holds the job.
        try:
            remaining = job.params.max_tokens - len(job.resumed_token_ids)
            if remaining <= 0:  # the previous worker streamed everything but the end
                reported = True
                await backend.publish_step(
                    job.job_id,
                    worker,
                    (),
                    finish_reason="length",
                    queue_wait_ms=running.queue_wait_ms,
                )
                return
            # The engine continues after the resumed tokens, which count toward max_tokens.
            request = {
                "request_id": running.engine_request_id,
                "priority": _priority(job),
                "resumed_token_ids": job.resumed_token_ids,
            }
            prompt = list(job.prompt_token_ids)
            params = job.params
            if job.resumed_token_ids and params.prompt_logprobs is not None:
                # The prompt's went out with the first token, which an earlier lease sent.
                params = replace(params, prompt_logprobs=None)
            # Steps that finish while a publish is on its way go out together in the next
            # one: a fast engine costs one round trip per publish, not one per token.
            generate_batches = getattr(self._engine, "generate_batches", None)
            if generate_batches is not None:
                batches = generate_batches(prompt, params, **request)
            else:
                batches = _batches(self._engine.generate(prompt, params, **request))
            async with contextlib.aclosing(batches):
                async for batch in batches:  # leaving early aborts in the engine
                    # An output means the engine finished a step and took its pending adds.
                    self._capacity_freed.set()
                    new_ids = [t for output in batch for t in output.new_token_ids]
                    text = "".join(output.text_delta for output in batch)
                    finish_reason = _finish_reason(batch[-1])
                    logprobs = [
                        lp for output in batch for lp in getattr(output, "new_logprobs", ())
                    ]
                    # Only a job's first output carries them: the first of its first batch.
                    prompt_logprobs = getattr(batch[0], "prompt_logprobs", None)
                    if finish_reason is not None:
                        if finish_reason != "length":
                            # Before the client hears of the end, so that its next
                            # request does not meet this job's unused tokens.
                            self._report_capacity_soon()
                        reported = True
                    if new_ids or text or finish_reason is not None:
                        published = await self._publish_step(
                            running, new_ids, text, finish_reason, logprobs, prompt_logprobs
                        )
                        if not published:
                            return  # cancelled, or reclaimed by another worker
                        running.queue_wait_ms = None  # sent
                    if finish_reason is not None:
                        return
                    if running.is_handed_back:
                        raise _HandBack
        except asyncio.CancelledError:
            await _quietly(backend.requeue(job.job_id, worker_id=worker))
            raise
        except _HandBack:
            await _quietly(backend.requeue(job.job_id, worker_id=worker))
        except EngineDeadError:
            # This engine is gone; another worker resumes the job.
            await _quietly(backend.requeue(job.job_id, worker_id=worker))
        except InvalidRequestError as exc:
            await _quietly(
                backend.fail(
                    job.job_id, code=INVALID_REQUEST, message=exc.message, worker_id=worker
                )
            )
        except BackendUnavailableError as exc:
            # Results cannot be delivered; the lease lapses and another worker resumes it.
            log.warning("job %s: the queue is unreachable (%s)", job.job_id, exc)
        except Exception as exc:
            log.exception("job %s failed", job.job_id)
            await _quietly(
                backend.fail(job.job_id, code=ENGINE_ERROR, message=repr(exc), worker_id=worker)
            )
        finally:
            self._ended(job.job_id)
            self._capacity_freed.set()
            if not reported:  # cancelled, failed or handed back on the way
                self._report_capacity_soon()

    async def _publish_step(
        self,
        running: _Running,
        token_ids: list[int],
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bool:
        """Publish one step (QueueBackend.publish_step), with the lease's queue wait on
        its first; False when this worker no longer holds the job."""
        return await self._backend.publish_step(
            running.job.job_id,
            self.worker_id,
            token_ids,
            text,
            finish_reason=finish_reason or "",
            queue_wait_ms=running.queue_wait_ms,
            logprobs=encode_logprobs(logprobs, prompt_logprobs),
        )

    # ----------------------------------------------------------------- heartbeat
    async def _heartbeat(self) -> None:
        interval_s = self._config.heartbeat_ms / 1000.0
        while True:
            try:
                await self._beat()
            except BackendUnavailableError as exc:
                log.warning("heartbeat: %s", exc)
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(interval_s)

    async def _beat(self) -> None:
        await self.publish_capacity()
        for job_id, running in list(self._running.items()):
            is_held = await self._backend.renew(self.worker_id, job_id, self._config.lease_ms)
            # Cancelled by its client, abandoned with its gateway or taken over: stop
            # spending the GPU on it.
            if not is_held and running.task is not None:
                running.task.cancel()
        if await self._backend.reclaim_expired_leases():
            self._wake.set()


def _priority(job: Job) -> Priority:
    # The engine's clock is monotonic; the job's arrival is wall-clock epoch seconds.
    waited_s = max(0.0, time.time() - job.arrival_s)
    return Priority(
        rank=job.rank,
        tenant=job.tenant_id,
        arrival_s=time.monotonic() - waited_s,
        ttft_slo_ms=job.ttft_slo_ms,
        tpot_slo_ms=job.tpot_slo_ms,
        preemptible=job.preemptible,
    )


def _finish_reason(output: Any) -> str | None:
    """Why the job ended with this output ("stop" when the engine gives none), or None
    while it runs on."""
    if not output.finished:
        return None
    return "stop" if output.finish_reason is None else str(output.finish_reason)


async def _batches(outputs: AsyncIterator[Any]) -> AsyncIterator[list[Any]]:
    """The engine's outputs in lists: each holds every output that arrived since the
    previous list was taken (at least one). Closing this closes `outputs`, which aborts
    the request in the engine."""
    pending: list[Any] = []
    arrived = asyncio.Event()
    ended: list[BaseException | None] = []  # [None] at the end, [error] on failure

    async def pump() -> None:
        try:
            async for output in outputs:
                pending.append(output)
                arrived.set()
            ended.append(None)
        except BaseException as exc:  # the engine's error ends the batches with it
            ended.append(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            arrived.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            await arrived.wait()
            arrived.clear()
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
            elif ended:
                if ended[0] is not None:
                    raise ended[0]
                return
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await outputs.aclose()  # type: ignore[attr-defined]


async def _wait(event: asyncio.Event, timeout_ms: float) -> None:
    # asyncio.timeout, not wait_for: the leasing loop waits here about twice a job, and
    # wait_for wraps each wait in a task of its own.
    if not event.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_ms / 1000.0):
                await event.wait()
    event.clear()


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:
        log.warning("queue update failed: %r", exc)
