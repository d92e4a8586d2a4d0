"""Capacity reports carry the engines' backlog per rank, from the step scheduler through
the engine's stats and the dispatcher to both queue backends, where admission reads it."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import pytest

from engine.block_manager import BlockManager
from engine.request import Priority, Request, SamplingParams
from engine.step_scheduler import SchedulerConfig, StepScheduler
from engine.stop_hazard import NUM_BUCKETS, StopCurve
from scheduler.backend import best_rank_waiting
from scheduler.dispatcher import Dispatcher, DispatcherConfig
from scheduler.job import Job
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.results import JobClient


def _request(request_id: str, rank: int, num_prompt_tokens: int, max_tokens: int) -> Request:
    return Request(
        request_id,
        list(range(1, num_prompt_tokens + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        Priority(rank=rank),
    )


def test_step_scheduler_backlog_counts_unprefilled_and_left_to_generate_by_rank() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk_tokens=16)
    scheduler = StepScheduler(config, BlockManager(64, 4))
    assert scheduler.backlog().unprefilled_tokens_by_rank == {}
    scheduler.add(_request("vip", 0, 10, 5))
    scheduler.add(_request("bulk", 2, 30, 8))
    scheduler.add(_request("bulk2", 2, 4, 3))
    backlog = scheduler.backlog()
    assert backlog.unprefilled_tokens_by_rank == {0: 10, 2: 34}
    assert backlog.decode_tokens_by_rank == {0: 5, 2: 11}
    # One step of 16 tokens: vip's whole prompt (it samples its first token) and the
    # first 6 tokens of bulk's; bulk2 still waits.
    plan = scheduler.schedule()
    for chunk in plan.chunks:
        if chunk.produces_token:
            chunk.request.output_token_ids.append(7)
    assert {c.request.request_id: c.num_tokens for c in plan.chunks} == {"vip": 10, "bulk": 6}
    backlog = scheduler.backlog()
    assert backlog.unprefilled_tokens_by_rank == {2: 24 + 4}
    assert backlog.decode_tokens_by_rank == {0: 4, 2: 11}


def test_step_scheduler_backlog_says_when_slots_free_and_what_may_be_preempted() -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_chunk_tokens=64)
    scheduler = StepScheduler(config, BlockManager(64, 4))

    def run_step() -> None:
        for chunk in scheduler.schedule().chunks:
            if chunk.produces_token:
                chunk.request.output_token_ids.append(7)

    assert scheduler.backlog().running_left == ()
    scheduler.add(_request("bulk", 2, 4, 9))  # ignore_eos: it ends only at max_tokens
    run_step()
    # A slot is still free: a newcomer waits for no release.
    assert scheduler.backlog().running_left == ()
    chat = Request("chat", [1, 2, 3], SamplingParams(max_tokens=5), Priority(1, preemptible=False))
    scheduler.add(chat)  # may stop early (end of sequence)
    run_step()
    backlog = scheduler.backlog()
    # (max_tokens left, tokens made, may stop early)
    assert sorted(backlog.running_left) == [(4, 1, True), (7, 2, False)]
    # Preemptible batch work runs: ranks better than 2 may displace it.
    assert backlog.preemptible_by_rank == {2: 1}
    assert best_rank_waiting(backlog.waiting_by_rank) == math.inf
    # With a measured stop hazard, the chat (which may stop early) counts the tokens it
    # is expected to make; bulk, which cannot stop early, all it may.
    assert backlog.decode_tokens_by_rank == {1: 4, 2: 7}
    hazard = 0.25  # one stop in 4 tokens, at every age
    expected_chat = (1 - (1 - hazard) ** 4) / hazard
    curve = StopCurve([hazard] * NUM_BUCKETS)
    assert scheduler.backlog(curve).decode_tokens_by_rank == {1: round(expected_chat), 2: 7}
    # A better rank waiting inside the engine goes first: it is the best rank waiting.
    scheduler.add(_request("vip", 0, 4, 2))
    backlog = scheduler.backlog()
    assert best_rank_waiting(backlog.waiting_by_rank) == 0
    assert len(backlog.running_left) == 2  # waiting requests hold no slot


async def test_fleet_sums_backlog_per_rank_over_live_workers(backend, clock) -> None:
    await backend.publish_capacity(
        "w1",
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        ttl_ms=3_000,
        unprefilled_tokens_by_rank={0: 10, 2: 500},
        decode_tokens_by_rank={0: 4, 2: 80},
    )
    clock.advance(2_000)
    await backend.publish_capacity(
        "w2",
        prefill_tokens_per_s=500.0,
        decode_tokens_per_s=50.0,
        ttl_ms=3_000,
        unprefilled_tokens_by_rank={1: 7, 2: 1},
        decode_tokens_by_rank={1: 9},
    )
    fleet = await backend.fleet_capacity()
    assert fleet.num_workers == 2
    assert dict(fleet.unprefilled_tokens_by_rank) == {0: 10, 1: 7, 2: 501}
    assert dict(fleet.decode_tokens_by_rank) == {0: 4, 1: 9, 2: 80}
    assert fleet.backlog_ahead(1).num_prefill_tokens == 17
    assert fleet.backlog_ahead(1).num_decode_tokens == 13
    # A new report replaces the worker's previous backlog; one without any clears it.
    await backend.publish_capacity(
        "w2", prefill_tokens_per_s=500.0, decode_tokens_per_s=50.0, ttl_ms=3_000
    )
    fleet = await backend.fleet_capacity()
    assert dict(fleet.unprefilled_tokens_by_rank) == {0: 10, 2: 500}
    assert dict(fleet.decode_tokens_by_rank) == {0: 4, 2: 80}
    # A lapsed worker's backlog stops counting with its rates.
    clock.advance(1_000)
    fleet = await backend.fleet_capacity()
    assert fleet.num_workers == 1
    assert dict(fleet.unprefilled_tokens_by_rank) == {}
    assert fleet.backlog_ahead(2).num_decode_tokens == 0


@pytest.fixture(scope="module")
def engine():
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    eng = AsyncEngine(
        EngineConfig(model="tiny-random", device="cpu", max_num_seqs=1, max_model_len=128)
    )
    eng.start()
    yield eng
    eng.shutdown()


async def test_dispatcher_publishes_its_engines_backlog(engine) -> None:
    backend = MemoryBackend([TierConfig("rank2", rank=2)])
    config = DispatcherConfig(lease_ms=2_000, heartbeat_ms=100, capacity_ttl_ms=1_000)
    dispatcher = Dispatcher(backend, engine, worker_id="w1", config=config)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    await dispatcher.publish_capacity()
    assert (await backend.fleet_capacity()).num_free_seqs == 1  # its one slot is free
    job = Job(
        job_id="long",
        tenant_id="t",
        tier="rank2",
        rank=2,
        weight=1.0,
        prompt_token_ids=(5, 6, 7),
        params=SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
        arrival_s=time.time(),
        preemptible=True,
    )
    try:
        stream = (await jobs.submit_and_wait(job)).__aiter__()
        await anext(stream)  # prefilled and decoding in the engine, gone from the queue
        for _ in range(250):  # the engine thread publishes its stats after the step
            if engine.stats().num_running == 1:
                break
            await asyncio.sleep(0.02)
        await dispatcher.publish_capacity()
        fleet = await backend.fleet_capacity()
        queued = (await backend.depth()).get("rank2")
        assert queued is None or queued.num_jobs == 0
        assert 0 < fleet.decode_tokens_by_rank[2] < 120
        assert set(fleet.decode_tokens_by_rank) == {2}
        assert fleet.num_free_seqs == 0
        # Its one slot frees when the job ends (ignore_eos: at its max_tokens), at the
        # engine's step time; a better rank may preempt it and waits for nothing.
        [report] = await backend.worker_reports()
        assert report.num_preemptible_seqs == 1
        [release_ms] = report.release_ms
        assert 0 < release_ms <= 1000.0 * 120 / report.decode_tokens_per_s
        assert fleet.release_ms == (release_ms,)
        assert (fleet.num_preemptible_seqs(1), fleet.num_preemptible_seqs(2)) == (1, 0)
        assert await jobs.cancel("long")
        for _ in range(250):  # the engine thread publishes stats after its next step
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.02)
        await dispatcher.publish_capacity()
        fleet = await backend.fleet_capacity()
        assert dict(fleet.decode_tokens_by_rank) == {}
        assert dict(fleet.unprefilled_tokens_by_rank) == {}
        assert fleet.num_free_seqs == 1
        assert fleet.release_ms == ()
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()


async def test_a_job_that_stops_early_leaves_no_backlog_behind(engine) -> None:
    # Admission adds the reported backlog to the work ahead; a job that stopped before
    # its max_tokens used to count there until the next heartbeat (a second), and a
    # client's next request to an idle server was refused as SLO-unattainable.
    prompt = (5, 6, 7)
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    tokens = [t async for out in engine.generate(list(prompt), greedy) for t in out.new_token_ids]
    stop_at = next(i for i in range(40, 80) if tokens[i] not in tokens[:i])
    backend = MemoryBackend([TierConfig("rank2", rank=2)])
    # Heartbeats far apart: only the report made at the job's end can clear its backlog.
    config = DispatcherConfig(lease_ms=20_000, heartbeat_ms=5_000, capacity_ttl_ms=10_000)
    dispatcher = Dispatcher(backend, engine, worker_id="w1", config=config)
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    params = SamplingParams(
        max_tokens=120, temperature=0, ignore_eos=True, stop_token_ids=(tokens[stop_at],)
    )
    job = Job("early", "t", "rank2", 2, 1.0, prompt, params, time.time())
    try:
        stream = await _running(jobs, engine, job)
        await dispatcher.publish_capacity()  # a heartbeat while it runs
        fleet = await backend.fleet_capacity()
        assert fleet.decode_tokens_by_rank[2] > 120 - stop_at
        outputs = [output async for output in stream]
        assert outputs[-1].finish_reason == "stop"
        assert outputs[-1].num_output_tokens == stop_at + 1
        await asyncio.sleep(0.01)  # a client's next request takes longer to arrive
        fleet = await backend.fleet_capacity()
        assert dict(fleet.decode_tokens_by_rank) == {}
    finally:
        await dispatcher.aclose(0)
        await jobs.aclose()


async def test_a_worker_may_report_a_quantile_of_the_slot_waits(engine) -> None:
    # Requests that stop early teach the engine its stop curve (its first 256 tokens
    # only count once seen); then a running request that may stop early holds the one
    # slot. A worker set to report the 90% quantile reports a later release than one
    # reporting the expected time, both from the same engine.
    prompt = (5, 6, 7)
    greedy = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    tokens = [t async for out in engine.generate(list(prompt), greedy) for t in out.new_token_ids]
    stop_at = next(i for i in range(20, 80) if tokens[i] not in tokens[:i])
    stopping = SamplingParams(
        max_tokens=80, temperature=0, ignore_eos=True, stop_token_ids=(tokens[stop_at],)
    )
    for _ in range(300 // (stop_at + 1) + 1):
        async for _ in engine.generate(list(prompt), stopping):
            pass
    assert engine.stats().stop_curve.is_measured
    backend = MemoryBackend([TierConfig("rank2", rank=2)])
    config = DispatcherConfig(lease_ms=20_000, heartbeat_ms=5_000, capacity_ttl_ms=10_000)
    dispatcher = Dispatcher(backend, engine, worker_id="expected", config=config)
    quantile = Dispatcher(
        backend, engine, worker_id="q90", config=replace(config, slot_wait_quantile=0.9)
    )
    jobs = JobClient(backend, on_enqueue=dispatcher.notify)
    dispatcher.start()
    # It may stop early (a stop token), which greedy decoding never makes: it runs on.
    never = next(t for t in range(10, 900) if t not in tokens)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, stop_token_ids=(never,))
    job = Job("chat", "t", "rank2", 2, 1.0, prompt, params, time.time())
    try:
        await _running(jobs, engine, job)
        await dispatcher.publish_capacity()
        await quantile.publish_capacity()
        reports = {r.worker_id: r for r in await backend.worker_reports()}
        [expected] = reports["expected"].release_ms
        [late] = reports["q90"].release_ms
        assert 0 < expected < late
    finally:
        await jobs.cancel("chat")
        await dispatcher.aclose(0)
        await quantile.aclose(0)
        await jobs.aclose()
    with pytest.raises(ValueError, match="slot_wait_quantile"):
        DispatcherConfig(slot_wait_quantile=1.0)


async def _running(jobs: JobClient, engine, job: Job):
    """Submit `job` and return its result stream once the engine runs it."""
    stream = (await jobs.submit_and_wait(job)).__aiter__()
    await anext(stream)
    for _ in range(250):  # the engine thread publishes its stats after the step
        if engine.stats().num_running == 1:
            break
        await asyncio.sleep(0.01)
    return stream
