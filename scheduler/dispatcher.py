"""Feeds queued jobs to a local engine and streams each job's outputs back to its caller.

The dispatcher pulls from the queue only when the engine says it can take work, so the
queue (not the engine's waiting list) holds the backlog and decides the order. Each
submitted job gets a `JobStream` the caller iterates; cancelling it removes the job from
the queue or aborts it in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.errors import EngineDeadError, RequestAbortedError
from engine.request import Priority, SamplingParams
from scheduler.job import Job
from scheduler.local_queue import LocalQueue

log = logging.getLogger(__name__)

# How often a full engine is asked again whether it can take work. A finishing job wakes
# the loop at once; the poll only covers capacity freed inside the engine otherwise.
CAPACITY_POLL_S = 0.002


class EngineLike(Protocol):
    """What the dispatcher needs from `engine.async_engine.AsyncEngine`."""

    def can_accept(self) -> bool: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        priority: Priority,
    ) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> Any: ...


_END = object()


class JobStream:
    """The caller's end of one job: iterate it for the engine's incremental outputs.

    Iteration ends when the job finishes, raises the engine's error if it failed, and
    raises RequestAbortedError if the job was cancelled.
    """

    def __init__(self, job: Job, enqueued_s: float) -> None:
        self.job = job
        self.enqueued_s = enqueued_s  # monotonic
        self.dispatched_s: float | None = None  # monotonic, set when the engine takes it
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._error: BaseException | None = None
        self._ended = False

    @property
    def queue_wait_ms(self) -> float | None:
        if self.dispatched_s is None:
            return None
        return (self.dispatched_s - self.enqueued_s) * 1000.0

    def _put(self, output: Any) -> None:
        self._items.put_nowait(output)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._items.put_nowait(_END)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            item = await self._items.get()
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item


class Dispatcher:
    """Moves jobs from a LocalQueue into an engine as capacity allows."""

    def __init__(self, queue: LocalQueue, engine: EngineLike) -> None:
        self._queue = queue
        self._engine = engine
        self._streams: dict[str, JobStream] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._capacity_freed = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def submit(self, job: Job) -> JobStream:
        """Queue a job; the returned stream yields its outputs once it runs."""
        if self._closed:
            raise EngineDeadError("the dispatcher is shut down")
        stream = JobStream(job, time.monotonic())
        self._queue.push(job)
        self._streams[job.job_id] = stream
        return stream

    async def cancel(self, job_id: str) -> None:
        """Drop a queued job or abort a running one (frees its KV blocks). Idempotent."""
        stream = self._streams.pop(job_id, None)
        if self._queue.remove(job_id):
            if stream is not None:
                stream._end(RequestAbortedError(f"request {job_id} was cancelled"))
            return
        task = self._running.get(job_id)
        if task is not None:
            await _maybe_await(self._engine.abort(job_id))
            task.cancel()

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="dispatcher")

    async def aclose(self) -> None:
        """Stop pulling, abort running jobs, fail queued ones with EngineDeadError."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for job_id in list(self._running):
            await self.cancel(job_id)
        if self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)
        while (job := self._queue.pop()) is not None:
            stream = self._streams.pop(job.job_id, None)
            if stream is not None:
                stream._end(EngineDeadError("the server is shutting down"))

    async def _run(self) -> None:
        while True:
            await self._queue.wait_nonempty()
            if not self._engine.can_accept():
                self._capacity_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity_freed.wait(), CAPACITY_POLL_S)
                continue
            job = self._queue.pop()
            if job is None:
                continue
            stream = self._streams.get(job.job_id)
            if stream is None:  # cancelled between push and pop
                continue
            stream.dispatched_s = time.monotonic()
            self._running[job.job_id] = asyncio.create_task(
                self._drive(stream), name=f"job-{job.job_id}"
            )
            # Let the new job reach the engine before asking it about capacity again.
            await asyncio.sleep(0)

    async def _drive(self, stream: JobStream) -> None:
        job = stream.job
        error: BaseException | None = None
        try:
            outputs = self._engine.generate(
                list(job.prompt_token_ids),
                job.params,
                request_id=job.job_id,
                priority=_priority(job),
            )
            async for output in outputs:
                stream._put(output)
                # An output means the engine finished a step and took its pending adds:
                # it may accept more now.
                self._capacity_freed.set()
        except asyncio.CancelledError:
            error = RequestAbortedError(f"request {job.job_id} was cancelled")
            raise
        except Exception as exc:
            error = exc
        finally:
            stream._end(error)
            self._running.pop(job.job_id, None)
            self._streams.pop(job.job_id, None)
            self._capacity_freed.set()


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


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value
