"""The dispatcher and the job client on the real engine (tiny-random on the CPU).

Jobs go through a real queue backend (in memory, and Redis where it matters): rank
order, cancellation of queued and running jobs, a resumed job continuing after the tokens
its client already has, and a drain that hands running work back to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis.asyncio as aioredis

from engine.errors import EngineDeadError, RequestAbortedError
from engine.request import SamplingParams
from scheduler.backend import JobStatus
from scheduler.dispatcher import Dispatcher, DispatcherConfig
from scheduler.job import Job
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.redis_backend import RedisBackend
from scheduler.results import JobClient, QueueTimeoutError
from tests.scheduler.conftest import REDIS_URL, delete_keys, unique_keys

TIERS = [TierConfig("rank0", rank=0), TierConfig("rank2", rank=2)]
PROMPT = (5, 6, 7)
FAST = DispatcherConfig(lease_ms=400, heartbeat_ms=100, capacity_ttl_ms=1_000)


@pytest.fixture(scope="module")
def engine():
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    # One sequence at a time, so the queue (not the engine) decides who runs next.
    eng = AsyncEngine(
        EngineConfig(model="tiny-random", device="cpu", max_num_seqs=1, max_model_len=128)
    )
    eng.start()
    yield eng
    eng.shutdown()


def _job(job_id: str, rank: int, max_tokens: int, **kwargs) -> Job:
    return Job(
        job_id=job_id,
        tenant_id="t",
        tier=f"rank{rank}",
        rank=rank,
        weight=1.0,
        prompt_token_ids=PROMPT,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        arrival_s=time.time(),
        **kwargs,
    )


async def _drain(stream) -> list:
    return [output async for output in stream]


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


async def _idle(engine) -> None:
    for _ in range(250):  # the engine thread publishes stats after its next step
        if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine still runs a request")


async def _reference(engine, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return _tokens([o async for o in engine.generate(list(PROMPT), params)])


async def test_streams_outputs_and_orders_by_rank(engine) -> None:
    backend = MemoryBackend(TIERS)
    dispatcher = Dispatcher(backend, engine, config=FAST)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    try:
        first = await jobs.submit_and_wait(_job("first", 2, 12))
        await asyncio.sleep(0.05)  # `first` occupies the only sequence slot
        late_batch = await jobs.submit_and_wait(_job("late-batch", 2, 2))
        urgent = await jobs.submit_and_wait(_job("urgent", 0, 2))
        outputs, _, _ = await asyncio.gather(_drain(first), _drain(late_batch), _drain(urgent))
        # Every step's tokens, in order, then the end (steps that finish while a publish
        # is on its way go out together).
        assert all(o.new_token_ids for o in outputs[:-1])
        assert sum(len(o.new_token_ids) for o in outputs) == 12
        assert not outputs[-1].new_token_ids
        assert outputs[-1].finished
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].num_output_tokens == 12
        assert outputs[-1].num_prompt_tokens == len(PROMPT)
        assert _tokens(outputs) == await _reference(engine, 12)
        assert urgent.dispatched_s is not None
        assert late_batch.dispatched_s is not None
        assert urgent.dispatched_s < late_batch.dispatched_s
        assert urgent.queue_wait_ms is not None
        assert urgent.queue_wait_ms >= 0
        assert await backend.job_status("first") is JobStatus.DONE
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()


async def test_cancel_queued_and_running_jobs(engine) -> None:
    backend = MemoryBackend(TIERS)
    dispatcher = Dispatcher(backend, engine, config=FAST)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    try:
        running = await jobs.submit_and_wait(_job("running", 2, 100))
        outputs = running.__aiter__()
        await anext(outputs)
        queued = await jobs.submit_and_wait(_job("queued", 2, 2))
        assert await jobs.cancel("queued")
        with pytest.raises(RequestAbortedError):
            await _drain(queued)
        assert await jobs.cancel("running")
        with pytest.raises(RequestAbortedError):
            async for _ in outputs:
                pass
        await _idle(engine)  # the worker saw its publish refused and aborted the request
        assert await backend.job_status("running") is JobStatus.CANCELLED
        assert await backend.job_status("queued") is JobStatus.CANCELLED
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()


async def test_resumed_job_continues_after_streamed_tokens(engine) -> None:
    """A worker died after streaming 5 tokens: the next one continues at token 6."""
    reference = await _reference(engine, 12)
    backend = MemoryBackend(TIERS)
    jobs = JobClient(backend)
    stream = await jobs.submit_and_wait(_job("resume", 2, 12))
    dead = await backend.dispatch("dead-worker", lease_ms=100)
    assert dead is not None
    assert await backend.publish_tokens("resume", "dead-worker", ())
    assert await backend.publish_tokens("resume", "dead-worker", reference[:5])
    assert await backend.reclaim_expired_leases(now_ms=int(time.time() * 1000) + 1_000)
    dispatcher = Dispatcher(backend, engine, config=FAST)
    dispatcher.start()
    try:
        outputs = await asyncio.wait_for(_drain(stream), 30)
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()
    assert _tokens(outputs) == reference  # no duplicate, no gap
    assert outputs[-1].num_output_tokens == 12


class SlowConsumer:
    """The real engine, read slowly: its worker publishes a token every 20 ms, so a drain
    surely catches the job mid-stream."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def can_accept(self, rank=None) -> bool:
        return self._engine.can_accept(rank)

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    async def generate(self, *args, **kwargs):
        async with contextlib.aclosing(self._engine.generate(*args, **kwargs)) as outputs:
            async for output in outputs:
                await asyncio.sleep(0.02)
                yield output


async def test_drain_requeues_running_work_for_another_worker(engine) -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    backend = RedisBackend(client, keys=keys)
    await backend.configure_tiers(TIERS)
    reference = await _reference(engine, 40)
    jobs = JobClient(backend, poll_ms=100)
    first = Dispatcher(backend, SlowConsumer(engine), worker_id="first", config=FAST)
    second = Dispatcher(backend, engine, worker_id="second", config=FAST)
    try:
        stream = await jobs.submit_and_wait(_job("drained", 2, 40))
        first.start()
        outputs = stream.__aiter__()
        seen = [await anext(outputs) for _ in range(3)]
        await first.aclose(drain_timeout_s=0)  # SIGTERM with no time to finish
        assert await backend.job_status("drained") is JobStatus.QUEUED
        await _idle(engine)
        second.start()
        seen += [o async for o in outputs]
        assert _tokens(seen) == reference
        assert await backend.job_status("drained") is JobStatus.DONE
        assert first.num_dispatched == 1
        assert second.num_dispatched == 1
    finally:
        await second.aclose(0)
        await jobs.aclose()
        await delete_keys(client, keys)
        await client.aclose()


async def test_queue_timeout_when_no_worker_takes_the_job() -> None:
    backend = MemoryBackend(TIERS)
    jobs = JobClient(backend)
    stream = await jobs.submit_and_wait(_job("late", 0, 2, max_queue_ms=50), queue_timeout_ms=80)
    with pytest.raises(QueueTimeoutError):
        await _drain(stream)
    assert await backend.job_status("late") is JobStatus.CANCELLED


async def test_closed_client_fails_open_streams_and_refuses_new_jobs() -> None:
    backend = MemoryBackend(TIERS)
    jobs = JobClient(backend)  # no worker: everything stays queued
    waiting = await jobs.submit_and_wait(_job("waiting", 2, 2))
    await jobs.aclose()
    with pytest.raises(EngineDeadError):
        await _drain(waiting)
    with pytest.raises(EngineDeadError):
        jobs.submit(_job("late", 2, 2))
    assert await backend.job_status("waiting") is JobStatus.CANCELLED


class CountingBackend(MemoryBackend):
    """The in-memory queue, counting the dispatcher's calls and the jobs each returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leases: list[tuple[str, int]] = []
        self.short_at: list[tuple[float, float]] = []  # a call that came back short, the next

    def _note(self, name: str, num_asked: int, num_got: int) -> None:
        now = time.monotonic()
        if self.short_at and self.short_at[-1][1] == 0.0:
            self.short_at[-1] = (self.short_at[-1][0], now)
        if num_got < num_asked:
            self.short_at.append((now, 0.0))
        self.leases.append((name, num_got))

    async def dispatch(self, worker_id: str, lease_ms: int):
        job = await super().dispatch(worker_id, lease_ms)
        self._note("dispatch", 1, int(job is not None))
        return job

    async def dispatch_many(self, worker_id: str, lease_ms: int, num_jobs: int):
        jobs = []
        for _ in range(num_jobs):  # not through dispatch: one call is one call
            job = await super().dispatch(worker_id, lease_ms)
            if job is None:
                break
            jobs.append(job)
        self._note("dispatch_many", num_jobs, len(jobs))
        return jobs


async def test_a_burst_is_leased_in_one_call_up_to_the_engines_room() -> None:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine(
        EngineConfig(model="tiny-random", device="cpu", max_num_seqs=4, max_model_len=128)
    )
    engine.start()
    backend = CountingBackend(TIERS)
    dispatcher = Dispatcher(backend, engine, config=FAST)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    try:
        streams = [await jobs.submit_and_wait(_job(f"j{i}", 2, 4)) for i in range(6)]
        dispatcher.start()
        results = await asyncio.gather(*(_drain(s) for s in streams))
        assert all(r[-1].finished for r in results)
        # Four slots: the first call leases four jobs, a later one the other two.
        assert backend.leases[0] == ("dispatch_many", 4)
        assert sum(n for _, n in backend.leases) == 6
        # A call that came back short (the queue ran dry) is followed by the next one
        # only after the idle poll, not at once.
        gaps = [after - short for short, after in backend.short_at if after]
        assert gaps
        assert min(gaps) >= 0.9 * FAST.idle_poll_ms / 1000, gaps
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()
        engine.shutdown()


@pytest.mark.parametrize("queue", ["memory", "redis"])
async def test_the_queue_wait_the_client_sees_is_the_time_before_the_lease(
    engine, queue: str
) -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = unique_keys()
    backend = MemoryBackend(TIERS) if queue == "memory" else RedisBackend(client, keys=keys)
    await backend.configure_tiers(TIERS)
    await _idle(engine)
    jobs = JobClient(backend, poll_ms=100)
    dispatcher = Dispatcher(backend, engine, worker_id="w", config=FAST)
    try:
        started_s = time.monotonic()
        stream = await jobs.submit_and_wait(_job("waited", 0, 3))
        await asyncio.sleep(0.3)  # no worker yet: the job waits in the queue
        dispatcher.start()
        leased_by_s = time.monotonic() - started_s
        assert len(_tokens(await _drain(stream))) == 3
        # Known from the first event alone (no event of its own), and as long as the
        # job was left waiting: at least the 0.3 s, no more than until the lease.
        assert stream.queue_wait_ms is not None
        assert 300.0 <= stream.queue_wait_ms <= leased_by_s * 1000.0 + 250.0
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()
        await delete_keys(client, keys)
        await client.aclose()


async def test_a_better_rank_job_preempts_batch_work_filling_the_engine() -> None:
    # The one slot runs preemptible batch work; a rank-0 job arrives. The dispatcher asks
    # the full engine whether it takes rank 0, a rank it does not hold: it used to be
    # told no (the engine answered only for the ranks it held), and the job waited for
    # the whole batch generation.
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    # A batch generation of seconds, so that everything below happens while it runs.
    engine = AsyncEngine(
        EngineConfig(model="tiny-random", device="cpu", max_num_seqs=1, max_model_len=2048)
    )
    engine.start()
    backend = MemoryBackend(TIERS)
    dispatcher = Dispatcher(backend, engine, config=FAST)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    try:
        long = _job("batch", 2, 1500, preemptible=True)
        batch = (await jobs.submit_and_wait(long)).__aiter__()
        first = await anext(batch)  # running: it holds the only slot
        for _ in range(250):  # the loop thread takes its snapshot after delivering
            if engine.can_accept(0):
                break
            await asyncio.sleep(0.02)
        assert engine.can_accept(0)
        assert not engine.can_accept()
        assert not engine.can_accept(2)
        behind = [await jobs.submit_and_wait(_job(f"behind{i}", 2, 2)) for i in range(3)]
        urgent = await jobs.submit_and_wait(_job("urgent", 0, 2))
        urgent_outputs = await _drain(urgent)
        assert urgent_outputs[-1].finished
        # Served before the batch work ended, which then resumed where it was.
        assert await backend.job_status("batch") is JobStatus.LEASED
        # The batch jobs queued behind the urgent one stayed queued: the rank it was
        # leased for did not let them follow it into the full engine. (One may be
        # leased as the urgent job ends and frees the slot, which the preempted batch
        # job then takes back: a newcomer is handed over whenever a slot is free.)
        await asyncio.sleep(0.2)
        assert await backend.job_status("batch") is JobStatus.LEASED
        queued = (await backend.depth()).get("rank2")
        assert queued is not None
        assert queued.num_jobs >= 2
        rest = [first, *[output async for output in batch]]
        assert rest[-1].finish_reason == "length"
        assert rest[-1].num_output_tokens == 1500
        assert engine.stats().num_preemptions >= 1
        for stream in behind:
            assert (await _drain(stream))[-1].finished
        assert _tokens(rest) == await _reference(engine, 1500)
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()
        engine.shutdown()
