"""SLO-aware admission against both backends."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from scheduler.admission import (
    AdmissionConfig,
    NoCapacityError,
    admit,
    job_service_ms,
    predict_ttft_ms,
)
from scheduler.backend import (
    DuplicateJobError,
    FleetCapacity,
    QueueFullError,
    SloBudget,
    SloUnattainableError,
    UnknownTierError,
    WorkAhead,
)
from scheduler.policy import TierConfig

PRIORITY = TierConfig("priority", rank=0, ttft_slo_ms=500.0)
INTERACTIVE = TierConfig("interactive", rank=1, ttft_slo_ms=2_000.0)
BATCH = TierConfig("batch", rank=2, max_queued_jobs=3)


def test_prediction_formula() -> None:
    capacity = FleetCapacity(2, prefill_tokens_per_s=1_000.0, decode_tokens_per_s=100.0)
    work = WorkAhead(num_prefill_tokens=900.0, num_decode_tokens=40.0)
    assert predict_ttft_ms(work, 100, capacity, AdmissionConfig(), rank=1) == pytest.approx(1_200.0)
    with pytest.raises(NoCapacityError):
        predict_ttft_ms(work, 100, FleetCapacity(0, 0.0, 0.0), AdmissionConfig(), rank=1)


def test_one_jobs_service_time_counts_it_as_work_ahead_is_counted() -> None:
    capacity = FleetCapacity(2, prefill_tokens_per_s=1_000.0, decode_tokens_per_s=100.0)
    config = AdmissionConfig()
    # 200 prompt tokens at 1,000/s, and half of 40 tokens of decode at 100/s.
    service = job_service_ms(capacity, config, num_prompt_tokens=200, max_tokens=40)
    assert service == pytest.approx(400.0)
    # The same as the TTFT of a job with that job alone ahead of it, minus its own prompt.
    alone_ahead = WorkAhead(num_prefill_tokens=200.0, num_decode_tokens=40.0)
    assert service == pytest.approx(predict_ttft_ms(alone_ahead, 0, capacity, config, rank=1))
    no_workers = FleetCapacity(0, 0.0, 0.0)
    assert job_service_ms(no_workers, config, num_prompt_tokens=200, max_tokens=40) is None


def test_prediction_adds_engine_backlog_of_equal_or_better_rank_in_full() -> None:
    capacity = FleetCapacity(
        2,
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=100.0,
        unprefilled_tokens_by_rank={0: 300, 1: 200, 2: 5_000},
        decode_tokens_by_rank={0: 20, 1: 40, 2: 9_000},
    )
    work = WorkAhead(num_prefill_tokens=400.0, num_decode_tokens=0.0)
    config = AdmissionConfig()
    # Rank 1: queued 400 + held 300 + 200 + own 100 prompt tokens -> 1 s of prefill, and
    # half of the 60 held decode tokens at 100 tokens/s -> 0.3 s. Rank 2 work is ignored.
    assert predict_ttft_ms(work, 100, capacity, config, rank=1) == pytest.approx(1_300.0)
    # Rank 0 sees only its own rank's backlog: (400 + 300 + 100) / 1000 + 0.5 * 20 / 100.
    assert predict_ttft_ms(work, 100, capacity, config, rank=0) == pytest.approx(900.0)
    # The worst rank counts everything the engines hold.
    assert predict_ttft_ms(work, 100, capacity, config, rank=2) == pytest.approx(51_300.0)


async def test_engine_backlog_refuses_what_the_queue_alone_would_admit(backend, make_job) -> None:
    await backend.configure_tiers([PRIORITY, INTERACTIVE, BATCH])
    # The queue is empty; the backlog is inside the worker's engine.
    await backend.publish_capacity(
        "w1",
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=100.0,
        ttl_ms=60_000,
        unprefilled_tokens_by_rank={1: 1_500, 2: 50_000},
        decode_tokens_by_rank={1: 100},
    )
    job = make_job("me", "interactive", num_prompt_tokens=100)
    with pytest.raises(SloUnattainableError) as refused:
        await admit(backend, job, INTERACTIVE)
    # (1500 + 100) / 1000 s + 0.5 * 100 / 100 s = 2.1 s against a 2 s SLO.
    assert refused.value.predicted_ttft_ms == pytest.approx(2_100.0, abs=1)
    assert refused.value.retry_after_ms == 100
    # Priority runs before all of it in the engine: only its own prompt counts.
    predicted = await admit(backend, make_job("vip", "priority", num_prompt_tokens=100), PRIORITY)
    assert predicted == pytest.approx(100.0, abs=1)
    # Once the engine has prefilled its backlog (next report), interactive fits again.
    await backend.publish_capacity(
        "w1",
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=100.0,
        ttl_ms=60_000,
        unprefilled_tokens_by_rank={2: 50_000},
        decode_tokens_by_rank={1: 100},
    )
    # Queued ahead now: the priority job's 100 prompt and 16 decode tokens.
    predicted = await admit(backend, job, INTERACTIVE)
    assert predicted == pytest.approx(200.0 + 500.0 + 80.0, abs=1)


def test_decode_ahead_counts_only_once_no_sequence_slot_is_left() -> None:
    capacity = FleetCapacity(
        1,
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=100.0,
        decode_tokens_by_rank={1: 4_000},
        num_free_seqs=2,
    )
    config = AdmissionConfig()
    # Two slots free, one job queued ahead: both start at once; only prefill is ahead.
    one_ahead = WorkAhead(num_prefill_tokens=100.0, num_decode_tokens=50.0, num_jobs=1)
    assert predict_ttft_ms(one_ahead, 100, capacity, config, rank=1) == pytest.approx(200.0)
    # Two queued ahead take both slots: the job waits for decodes, queued and held.
    two_ahead = WorkAhead(num_prefill_tokens=100.0, num_decode_tokens=50.0, num_jobs=2)
    expected = 200.0 + 1000.0 * 0.5 * (50 + 4_000) / 100.0
    assert predict_ttft_ms(two_ahead, 100, capacity, config, rank=1) == pytest.approx(expected)
    full = FleetCapacity(1, 1_000.0, 100.0, decode_tokens_by_rank={1: 4_000})
    assert predict_ttft_ms(one_ahead, 100, full, config, rank=1) == pytest.approx(
        200.0 + 1000.0 * 0.5 * 4_050 / 100.0
    )


async def test_a_long_generation_leaves_free_slots_to_admit_into(backend, make_job) -> None:
    # One request generates thousands of tokens on an engine with slots to spare. Its
    # decode used to count as work ahead of everyone, and an idle fleet refused every
    # request of an SLO tier until it ended.
    await backend.configure_tiers([PRIORITY, INTERACTIVE, BATCH])

    async def report(num_free_seqs: int) -> None:
        await backend.publish_capacity(
            "w1",
            prefill_tokens_per_s=1_000.0,
            decode_tokens_per_s=100.0,
            ttl_ms=60_000,
            decode_tokens_by_rank={1: 4_000},
            num_free_seqs=num_free_seqs,
        )

    await report(2)
    # A worker that does not report free slots (an older version) adds none.
    await backend.publish_capacity(
        "w2", prefill_tokens_per_s=1_000.0, decode_tokens_per_s=100.0, ttl_ms=60_000
    )
    assert (await backend.fleet_capacity()).num_free_seqs == 2
    first = make_job("me", "interactive", num_prompt_tokens=100)
    assert await admit(backend, first, INTERACTIVE) == pytest.approx(50.0, abs=1)
    # The second finds the first queued ahead and a slot left for itself.
    second = make_job("you", "interactive", num_prompt_tokens=100)
    assert await admit(backend, second, INTERACTIVE) == pytest.approx(100.0, abs=1)
    # The third finds none left: the 4,000 held and 32 queued decode tokens count.
    third = make_job("me", "interactive", num_prompt_tokens=100)
    with pytest.raises(SloUnattainableError) as refused:
        await admit(backend, third, INTERACTIVE)
    assert refused.value.predicted_ttft_ms == pytest.approx(
        (100 + 100 + 100) / 2.0 + 1000.0 * 0.5 * (4_000 + 32) / 200.0, abs=1
    )
    # Leasing the two jobs takes the slots they were admitted into, before the worker's
    # next report: with the queue empty again, nothing is free to start at once.
    assert len(await backend.dispatch_many("w1", 10_000, 2)) == 2
    assert (await backend.fleet_capacity()).num_free_seqs == 0
    with pytest.raises(SloUnattainableError):
        await admit(backend, third, INTERACTIVE)
    # A job that ends gives its slot back before the worker reports again (one ending
    # at max_tokens triggers no early report).
    assert await backend.complete(first.job_id, worker_id="w1", finish_reason="length")
    assert (await backend.fleet_capacity()).num_free_seqs == 1
    assert await admit(backend, third, INTERACTIVE) == pytest.approx(50.0, abs=1)
    assert [j.job_id for j in await backend.dispatch_many("w1", 10_000, 2)] == [third.job_id]
    # Leased with no slot reported free (to preempt, say), a job has none to give back.
    extra = make_job("you", "interactive", num_prompt_tokens=100)
    await backend.enqueue(extra)
    assert [j.job_id for j in await backend.dispatch_many("w1", 10_000, 2)] == [extra.job_id]
    assert await backend.complete(extra.job_id, worker_id="w1", finish_reason="length")
    assert (await backend.fleet_capacity()).num_free_seqs == 0
    # Handed back or cancelled, a job gives its slot back too, once.
    assert await backend.requeue(second.job_id, worker_id="w1")
    assert await backend.cancel(third.job_id)
    assert not await backend.cancel(third.job_id)
    assert (await backend.fleet_capacity()).num_free_seqs == 2
    # The worker's next report says what is free itself.
    await report(1)
    [w1, w2] = await backend.worker_reports()
    assert (w1.num_free_seqs, w2.num_free_seqs) == (1, 0)


async def test_jobs_seated_since_the_report_count_ahead_of_a_burst(backend, make_job) -> None:
    """A gateway admits with a capacity report it read up to a moment ago. A burst a few
    milliseconds apart saw the same free slots after earlier jobs of the burst had been
    leased into them, and was admitted to wait for releases nobody had reported; their
    TTFTs ran to seconds and the queue dropped them at max_queue_ms."""
    await backend.configure_tiers([PRIORITY, INTERACTIVE, BATCH])

    async def report(num_free_seqs: int, decode: int = 0) -> None:
        await backend.publish_capacity(
            "w1",
            prefill_tokens_per_s=1_000.0,
            decode_tokens_per_s=100.0,
            ttl_ms=60_000,
            decode_tokens_by_rank={1: decode},
            num_free_seqs=num_free_seqs,
        )

    await report(2)
    stale = await backend.fleet_capacity()  # what the gateway holds for the burst
    first, second = (make_job(t, num_prompt_tokens=100, max_tokens=400) for t in ("a", "b"))
    for job in (first, second):
        assert await admit(backend, job, INTERACTIVE, capacity=stale) == pytest.approx(100, abs=1)
        assert len(await backend.dispatch_many("w1", 10_000, 1)) == 1  # seated at once
    # The third sees no slot left and the seated jobs' decode ahead of it, whatever the
    # stale report says: 0.1 s of prefill and half of 800 tokens at 100 tokens/s.
    third = make_job("c", num_prompt_tokens=100, max_tokens=400)
    with pytest.raises(SloUnattainableError) as refused:
        await admit(backend, third, INTERACTIVE, capacity=stale)
    assert refused.value.predicted_ttft_ms == pytest.approx(100 + 4_000, abs=1)
    # Work of a worse rank is no work ahead of a better one.
    assert await backend.work_ahead("priority", "c", 1.0, 100) == WorkAhead(0, 0, 0)
    # A seated job that ends gives back its slot and its decode.
    assert await backend.complete(first.job_id, worker_id="w1", finish_reason="stop")
    assert await admit(backend, third, INTERACTIVE, capacity=stale) == pytest.approx(100, abs=1)
    assert len(await backend.dispatch_many("w1", 10_000, 1)) == 1
    # The next report holds their work itself: the seated count starts over, and a job
    # seated before it gives back only its slot when it ends.
    await report(0, decode=800)
    assert (await backend.work_ahead("interactive", "d", 1.0, 100)).num_decode_tokens == 0
    assert await backend.complete(second.job_id, worker_id="w1", finish_reason="stop")
    assert (await backend.work_ahead("interactive", "d", 1.0, 100)).num_decode_tokens == 0
    assert (await backend.fleet_capacity()).num_free_seqs == 1


def test_a_job_without_a_slot_waits_for_its_turn_among_the_releases() -> None:
    config = AdmissionConfig()
    # Every slot taken: releases expected in 3, 4 and 9 s; one rank-2 sequence that
    # better ranks may preempt, on a worker where nothing waits.
    full = FleetCapacity(
        2,
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=100.0,
        decode_tokens_by_rank={1: 30, 2: 90},  # half of 120 tokens at 100/s: 600 ms
        release_ms=(3_000.0, 4_000.0, 9_000.0),
        preemptible=(({2: 1}, math.inf), ({1: 5}, 1)),
    )
    assert [full.num_preemptible_seqs(rank) for rank in (0, 1, 2)] == [6, 1, 0]

    def ttft(num_jobs: int, rank: int, capacity: FleetCapacity = full) -> float:
        work = WorkAhead(num_prefill_tokens=0.0, num_decode_tokens=0.0, num_jobs=num_jobs)
        return predict_ttft_ms(work, 100, capacity, config, rank=rank)

    # Rank 1 preempts the rank-2 sequence; the next rank-1 job waits for a release.
    assert ttft(0, rank=1) == pytest.approx(100.0)
    assert ttft(1, rank=1) == pytest.approx(3_100.0)
    # Rank 2 may preempt nothing: the k-th job without a slot takes the k-th release,
    # and past the reported ones they come at their average pace.
    assert [ttft(k, rank=2) for k in range(3)] == pytest.approx([3_100.0, 4_100.0, 9_100.0])
    assert ttft(5, rank=2) == pytest.approx(100.0 + 9_000.0 * 6 / 3)
    # A slot free: nobody waits for one; nothing running: nothing to wait for.
    assert ttft(0, rank=2, capacity=FleetCapacity(1, 1_000.0, 100.0, num_free_seqs=1)) == 100.0
    idle = FleetCapacity(1, 1_000.0, 100.0, release_ms=())
    assert ttft(3, rank=2, capacity=idle) == pytest.approx(100.0)
    # The releases are a floor under the decode ahead of the job's rank, not instead.
    long_decodes = replace(full, decode_tokens_by_rank={2: 2_000})
    assert ttft(0, rank=2, capacity=long_decodes) == pytest.approx(100.0 + 10_000.0)
    # A fleet with a worker that does not report releases counts decodes ahead alone.
    legacy = FleetCapacity(1, 1_000.0, 100.0, decode_tokens_by_rank={1: 300})
    assert ttft(0, rank=1, capacity=legacy) == pytest.approx(100.0 + 1000.0 * 0.5 * 300 / 100)


async def test_engines_full_of_work_that_may_not_be_preempted_refuse_a_better_rank(
    backend, make_job, clock
) -> None:
    # Every slot held by interactive work, which may not be preempted: a priority job
    # waits for the first of them to end. Its own rank's decode ahead is none, and it
    # was admitted at its prefill's TTFT and served 20 s later, against a 500 ms SLO.
    await backend.configure_tiers([PRIORITY, INTERACTIVE, BATCH])

    async def report(preemptible_by_rank: dict[int, int]) -> None:
        await backend.publish_capacity(
            "w1",
            prefill_tokens_per_s=1_000.0,
            decode_tokens_per_s=100.0,
            ttl_ms=60_000,
            decode_tokens_by_rank={1: 4_000},
            release_ms=[2_000.0, 2_500.0],
            preemptible_by_rank=preemptible_by_rank,
        )

    await report({})
    [worker] = await backend.worker_reports()
    assert (worker.release_ms, worker.num_preemptible_seqs) == ((2_000.0, 2_500.0), 0)
    vip = make_job("vip", "priority", num_prompt_tokens=100)
    with pytest.raises(SloUnattainableError) as refused:
        await admit(backend, vip, PRIORITY)
    assert refused.value.predicted_ttft_ms == pytest.approx(2_100.0)
    # Retry-After: when the slot has freed, the job fits again.
    assert refused.value.retry_after_ms == pytest.approx(1_600.0, abs=1)
    # The releases come nearer as the report ages, as the wait does.
    clock.advance(1_000)
    with pytest.raises(SloUnattainableError) as later:
        await admit(backend, vip, PRIORITY)
    assert later.value.retry_after_ms == pytest.approx(600.0, abs=1)
    # Had the engine run preemptible batch work, the priority job would displace it;
    # the one queued after it finds nothing left to displace and waits for a release.
    await report({2: 1})
    assert await admit(backend, vip, PRIORITY) == pytest.approx(100.0)
    second = make_job("vip2", "priority", num_prompt_tokens=100)
    with pytest.raises(SloUnattainableError) as behind:
        await admit(backend, second, PRIORITY)
    assert behind.value.predicted_ttft_ms == pytest.approx(100.0 + 100.0 + 2_000.0)


async def test_slo_unattainable_then_feasible_after_retry_after(backend, make_job) -> None:
    await backend.configure_tiers([PRIORITY, BATCH])
    await backend.publish_capacity(
        "w1", prefill_tokens_per_s=1_000.0, decode_tokens_per_s=100.0, ttl_ms=60_000
    )
    prefill_only = AdmissionConfig(decode_ahead_fraction=0.0)
    for _ in range(8):
        await backend.enqueue(make_job("me", "priority", num_prompt_tokens=100))
    with pytest.raises(SloUnattainableError) as refused:
        await admit(
            backend, make_job("me", "priority", num_prompt_tokens=100), PRIORITY, prefill_only
        )
    # 800 own tokens queued ahead + 100 at 1000 tokens/s: 900 ms predicted against 500 ms.
    assert refused.value.predicted_ttft_ms == pytest.approx(900.0, abs=1)
    assert refused.value.retry_after_ms == 400
    # Within retry_after the fleet prefills 400 tokens: four jobs ahead are gone.
    for _ in range(4):
        await backend.dispatch("w1", 10_000)
    me = make_job("me", "priority", num_prompt_tokens=100)
    predicted = await admit(backend, me, PRIORITY, prefill_only)
    assert predicted == pytest.approx(500.0, abs=1)


async def test_no_live_worker_refuses_slo_tiers(backend, make_job) -> None:
    await backend.configure_tiers([PRIORITY])
    with pytest.raises(NoCapacityError):
        await admit(backend, make_job("me", "priority"), PRIORITY)


async def test_batch_is_bounded_only_by_queue_caps(backend, make_job) -> None:
    await backend.configure_tiers([PRIORITY, BATCH])
    for _ in range(3):
        assert await admit(backend, make_job("b", "batch", num_prompt_tokens=10_000), BATCH) is None
    with pytest.raises(QueueFullError):
        await admit(backend, make_job("b", "batch"), BATCH)


async def test_concurrent_admissions_each_see_the_work_the_others_queued(backend, make_job) -> None:
    # Twenty requests arrive at once, as at several gateways. Checked apart from the
    # enqueue, all twenty would see an empty queue and all would be admitted; the queue
    # checks each against what it holds at that moment, so only those that fit are.
    await backend.configure_tiers([PRIORITY])
    await backend.publish_capacity(
        "w1", prefill_tokens_per_s=1_000.0, decode_tokens_per_s=100.0, ttl_ms=60_000
    )
    prefill_only = AdmissionConfig(decode_ahead_fraction=0.0)
    jobs = [make_job(f"t{i}", "priority", num_prompt_tokens=100) for i in range(20)]
    outcomes = await asyncio.gather(
        *(admit(backend, job, PRIORITY, prefill_only) for job in jobs), return_exceptions=True
    )
    admitted = [o for o in outcomes if isinstance(o, float)]
    refused = [o for o in outcomes if isinstance(o, SloUnattainableError)]
    # 500 ms of SLO at 1,000 prompt tokens/s: five jobs of 100 tokens, each predicted
    # after those queued before it.
    assert sorted(admitted) == pytest.approx([100.0, 200.0, 300.0, 400.0, 500.0])
    assert len(refused) == 15
    assert (await backend.depth())["priority"].num_jobs == 5


async def test_a_prompt_too_long_for_the_slo_runs_once_nothing_is_ahead(backend, make_job) -> None:
    """Its own prefill exceeds the SLO: no wait makes it fit, so it is admitted (at best
    effort) with nothing ahead, and refused with the time the work ahead needs to drain
    otherwise (not told to come back forever)."""
    await backend.configure_tiers([PRIORITY])
    rates = {"ttft_slo_ms": 50.0, "prefill_tokens_per_s": 1_000.0, "decode_tokens_per_s": 0.0}
    # Work the engines hold counts as ahead: 10 tokens of it, 10 ms.
    held = SloBudget(**rates, held_prefill_tokens=10)
    with pytest.raises(SloUnattainableError) as behind_held:
        await backend.enqueue(make_job("c", "priority", num_prompt_tokens=300), slo=held)
    assert behind_held.value.retry_after_ms == 10
    budget = SloBudget(**rates)
    long = make_job("a", "priority", num_prompt_tokens=200, job_id="long")
    assert await backend.enqueue(long, slo=budget) == pytest.approx(200.0)
    with pytest.raises(SloUnattainableError) as refused:
        await backend.enqueue(make_job("b", "priority", num_prompt_tokens=300), slo=budget)
    assert refused.value.predicted_ttft_ms == pytest.approx(500.0)
    assert refused.value.retry_after_ms == 200  # the 200 tokens ahead, at 1,000/s


async def test_an_slo_refusal_leaves_no_trace_and_checks_come_in_order(backend, make_job) -> None:
    await backend.configure_tiers([PRIORITY, BATCH])
    tight = SloBudget(
        ttft_slo_ms=150.0,
        prefill_tokens_per_s=1_000.0,
        decode_tokens_per_s=0.0,
        held_prefill_tokens=100,
    )
    loose = SloBudget(ttft_slo_ms=5_000.0, prefill_tokens_per_s=1_000.0, decode_tokens_per_s=0.0)
    job = make_job("me", "priority", num_prompt_tokens=100, job_id="refused-once")
    with pytest.raises(SloUnattainableError) as refused:
        await backend.enqueue(job, slo=tight)
    assert refused.value.predicted_ttft_ms == pytest.approx(200.0)
    assert refused.value.retry_after_ms == 50
    assert await backend.depth() == {}
    assert await backend.job_status(job.job_id) is None
    # Refused is not known: the same id is queued once it fits.
    assert await backend.enqueue(job, slo=loose) == pytest.approx(100.0)
    # Unknown tier before the SLO; the SLO before a duplicate id; a full queue after both.
    with pytest.raises(UnknownTierError):
        await backend.enqueue(make_job("me", "nope"), slo=tight)
    with pytest.raises(SloUnattainableError):
        await backend.enqueue(job, slo=tight)
    with pytest.raises(DuplicateJobError):
        await backend.enqueue(job, slo=loose)
    for _ in range(3):
        await backend.enqueue(make_job("b", "batch"), slo=loose)
    with pytest.raises(QueueFullError):
        await backend.enqueue(make_job("b", "batch"), slo=loose)
