"""The dispatcher on the real engine (tiny-random on the CPU): streaming, order, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.errors import EngineDeadError, RequestAbortedError
from engine.request import SamplingParams
from scheduler.dispatcher import Dispatcher
from scheduler.job import Job
from scheduler.local_queue import LocalQueue


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


def _job(job_id: str, rank: int, max_tokens: int) -> Job:
    return Job(
        job_id=job_id,
        tenant_id="t",
        tier=f"rank{rank}",
        rank=rank,
        weight=1.0,
        prompt_token_ids=(5, 6, 7),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        arrival_s=time.time(),
    )


async def _drain(stream) -> list:
    return [output async for output in stream]


async def test_streams_outputs_and_orders_by_rank(engine) -> None:
    dispatcher = Dispatcher(LocalQueue(), engine)
    dispatcher.start()
    try:
        first = dispatcher.submit(_job("first", 2, 12))
        await asyncio.sleep(0.05)  # `first` occupies the only sequence slot
        late_batch = dispatcher.submit(_job("late-batch", 2, 2))
        urgent = dispatcher.submit(_job("urgent", 0, 2))
        results = await asyncio.gather(_drain(first), _drain(late_batch), _drain(urgent))
        outputs = results[0]
        assert [len(o.new_token_ids) for o in outputs] == [1] * 12
        assert outputs[-1].finished
        assert outputs[-1].num_output_tokens == 12
        assert urgent.dispatched_s is not None
        assert late_batch.dispatched_s is not None
        assert urgent.dispatched_s < late_batch.dispatched_s
        assert urgent.queue_wait_ms is not None
        assert urgent.queue_wait_ms >= 0
    finally:
        await dispatcher.aclose()


async def test_cancel_queued_and_running_jobs(engine) -> None:
    dispatcher = Dispatcher(LocalQueue(), engine)
    dispatcher.start()
    try:
        running = dispatcher.submit(_job("running", 1, 100))
        outputs = running.__aiter__()
        await anext(outputs)
        queued = dispatcher.submit(_job("queued", 1, 2))
        await dispatcher.cancel("queued")
        with pytest.raises(RequestAbortedError):
            await _drain(queued)
        await dispatcher.cancel("running")
        with pytest.raises(RequestAbortedError):
            async for _ in outputs:
                pass
        for _ in range(250):  # the engine thread publishes stats after its next step
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.stats().num_running == 0
    finally:
        await dispatcher.aclose()


async def test_close_fails_queued_jobs_and_refuses_new_ones(engine) -> None:
    dispatcher = Dispatcher(LocalQueue(), engine)  # never started: everything stays queued
    waiting = dispatcher.submit(_job("waiting", 1, 2))
    await dispatcher.aclose()
    with pytest.raises(EngineDeadError):
        await _drain(waiting)
    with pytest.raises(EngineDeadError):
        dispatcher.submit(_job("late", 1, 2))
