"""Queue semantics, run against both backends (in-memory and a real Redis)."""

from __future__ import annotations

import asyncio
import gc
import math
from collections import Counter

import pytest

from engine.request import TokenLogprob
from scheduler.backend import (
    QUEUE_TIMEOUT,
    DuplicateJobError,
    EventKind,
    JobStatus,
    QueueFullError,
    QueueTotals,
    UnknownTierError,
)
from scheduler.logprobs import decode_logprobs, encode_logprobs
from scheduler.policy import PolicyConfigError, TierConfig
from scheduler.redis_backend import RedisBackend
from tests.scheduler.conftest import TIERS

LEASE_MS = 5_000


async def drain(backend, n: int, *, output_tokens: int = 0) -> list:
    """Dispatch n jobs, charging each its output tokens as if it ran to completion."""
    served = []
    for _ in range(n):
        job = await backend.dispatch("w1", LEASE_MS)
        if job is None:
            break
        if output_tokens:
            assert await backend.charge(job.job_id, output_tokens=output_tokens)
        assert await backend.complete(job.job_id, worker_id="w1")
        served.append(job)
    return served


async def test_arrival_order_within_a_tenant(backend, make_job) -> None:
    jobs = [make_job("a") for _ in range(5)]
    for job in jobs:
        await backend.enqueue(job)
    served = await drain(backend, 10)
    assert [j.job_id for j in served] == [j.job_id for j in jobs]


async def test_best_rank_first_and_rank_from_current_tier(backend, make_job) -> None:
    batch = make_job("a", "batch")
    prio = make_job("b", "priority")
    await backend.enqueue(batch)
    await backend.enqueue(prio)
    first = await backend.dispatch("w1", LEASE_MS)
    assert first.job_id == prio.job_id
    assert first.rank == 0
    second = await backend.dispatch("w1", LEASE_MS)
    assert (second.job_id, second.rank) == (batch.job_id, 2)
    assert await backend.dispatch("w1", LEASE_MS) is None


async def test_weights_one_to_three_share_tokens_one_to_three(backend, make_job) -> None:
    for _ in range(200):
        await backend.enqueue(make_job("light", weight=1.0, num_prompt_tokens=10))
        await backend.enqueue(make_job("heavy", weight=3.0, num_prompt_tokens=10))
    served = await drain(backend, 200, output_tokens=20)
    tokens = Counter()
    for job in served:
        tokens[job.tenant_id] += job.num_prompt_tokens + 20
    ratio = tokens["heavy"] / tokens["light"]
    assert ratio == pytest.approx(3.0, rel=0.03)


async def test_a_weight_change_applies_to_jobs_already_queued(backend, make_job) -> None:
    # Every job is queued at weight 1 (what the gateway knew); then b's weight becomes 3.
    for _ in range(200):
        await backend.enqueue(make_job("a", weight=1.0))
        await backend.enqueue(make_job("b", weight=1.0))
    before = await drain(backend, 20, output_tokens=20)
    assert Counter(j.tenant_id for j in before) == {"a": 10, "b": 10}
    assert await backend.set_tenant_weight("b", 3.0)
    served = await drain(backend, 160, output_tokens=20)
    # Service as the queue counts it: prompt and output tokens at their token weights.
    service = Counter()
    for job in served:
        service[job.tenant_id] += 1.0 * job.num_prompt_tokens + 2.0 * 20
    assert service["b"] / service["a"] == pytest.approx(3.0, rel=0.03)


async def test_a_tenant_weight_is_kept_while_it_has_jobs(
    backend, make_job, redis_client, keys
) -> None:
    from scheduler.memory_backend import MemoryBackend

    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(PolicyConfigError):
            await backend.set_tenant_weight("a", bad)
    assert not await backend.set_tenant_weight("a", 2.0)  # no job: nothing is kept
    assert await backend.tenant_weight("a") is None
    first, second = make_job("a", weight=1.0), make_job("a", weight=1.0)
    await backend.enqueue(first)
    await backend.enqueue(second)
    assert await backend.dispatch("w1", LEASE_MS) is not None  # first, leased
    assert await backend.set_tenant_weight("a", 4.0)
    assert await backend.tenant_weight("a") == 4.0
    counter = (await backend.counters("interactive"))["a"]
    assert await backend.charge(first.job_id, output_tokens=10)  # a running job: at 4
    assert (await backend.counters("interactive"))["a"] == counter + 2.0 * 10 / 4.0
    third = make_job("a", weight=2.0)
    await backend.enqueue(third)  # the latest weight the gateway knew
    assert await backend.tenant_weight("a") == 2.0
    assert await backend.complete(first.job_id, worker_id="w1")
    assert await backend.cancel(second.job_id)
    assert await backend.tenant_weight("a") == 2.0  # third is still queued
    assert await backend.cancel(third.job_id)
    assert await backend.tenant_weight("a") is None
    # Tokens reported after the tenant's last job finished: at that job's own weight.
    counter = (await backend.counters("interactive"))["a"]
    assert await backend.charge(first.job_id, output_tokens=10)
    assert (await backend.counters("interactive"))["a"] == counter + 2.0 * 10 / 1.0
    if isinstance(backend, MemoryBackend):
        assert backend._weights == {}
        assert backend._num_live_jobs == {}
    else:
        assert await redis_client.exists(keys.weights, keys.live_jobs) == 0


async def test_returning_tenant_is_lifted_not_credited(backend, make_job) -> None:
    for _ in range(60):
        await backend.enqueue(make_job("busy"))
    await drain(backend, 40, output_tokens=10)
    for _ in range(10):
        await backend.enqueue(make_job("back"))
    nxt = [j.tenant_id for j in await drain(backend, 10, output_tokens=10)]
    # Lifted to the busy tenant's counter it alternates with it; had it kept its zero
    # counter it would have taken all ten.
    assert 4 <= nxt.count("back") <= 6


async def test_tier_below_min_share_is_served_first(backend, make_job, clock) -> None:
    await backend.configure_tiers(
        [TierConfig("priority", rank=0), TierConfig("batch", rank=2, min_share=0.25)]
    )
    for _ in range(100):
        await backend.enqueue(make_job("p", "priority"))
        await backend.enqueue(make_job("b", "batch"))
    served = []
    for _ in range(80):
        served += await drain(backend, 1, output_tokens=10)
        clock.advance(50)
    batch_share = sum(j.tier == "batch" for j in served) / len(served)
    assert 0.22 <= batch_share <= 0.32


async def test_without_min_share_the_best_rank_wins(backend, make_job) -> None:
    for _ in range(20):
        await backend.enqueue(make_job("p", "priority"))
        await backend.enqueue(make_job("b", "batch"))
    served = await drain(backend, 20, output_tokens=10)
    assert {j.tier for j in served} == {"priority"}


async def test_batch_deadline_at_risk_is_promoted(backend, make_job, clock) -> None:
    now_s = clock.now_ms / 1000
    for _ in range(5):
        await backend.enqueue(make_job("p", "priority"))
    late = make_job("b", "batch", deadline_s=now_s + 60)
    urgent = make_job("b", "batch", deadline_s=now_s + 4)
    await backend.enqueue(late)
    await backend.enqueue(urgent)
    first = await backend.dispatch("w1", LEASE_MS)
    assert first.job_id == urgent.job_id
    assert (await backend.dispatch("w1", LEASE_MS)).tier == "priority"


async def test_queue_timeout_drops_and_tells_the_client(backend, make_job, clock) -> None:
    stale = make_job("a", arrival_s=clock.now_ms / 1000, max_queue_ms=1_000)
    fresh = make_job("a", arrival_s=clock.now_ms / 1000 + 2)
    await backend.enqueue(stale)
    await backend.enqueue(fresh)
    clock.advance(1_001)
    job = await backend.dispatch("w1", LEASE_MS)
    assert job.job_id == fresh.job_id
    assert await backend.job_status(stale.job_id) is JobStatus.DROPPED
    events = [e async for e in backend.results(stale.job_id)]
    assert [(e.kind, e.code) for e in events] == [(EventKind.ERROR, QUEUE_TIMEOUT)]


async def test_expired_lease_returns_to_the_head_and_resumes(backend, make_job, clock) -> None:
    a1, a2 = make_job("a"), make_job("a")
    await backend.enqueue(a1)
    await backend.enqueue(a2)
    job = await backend.dispatch("dead", LEASE_MS)
    assert await backend.publish_tokens(job.job_id, "dead", [7, 8], "xy")
    clock.advance(LEASE_MS - 1)
    assert await backend.reclaim_expired_leases() == []
    clock.advance(1)
    assert await backend.reclaim_expired_leases() == [a1.job_id]
    resumed = await backend.dispatch("w2", LEASE_MS)
    assert resumed.job_id == a1.job_id
    assert resumed.resumed_token_ids == (7, 8)
    # The dead worker's late writes are refused; the new owner's are taken.
    assert not await backend.publish_tokens(a1.job_id, "dead", [9])
    assert not await backend.renew("dead", a1.job_id, LEASE_MS)
    assert await backend.publish_tokens(a1.job_id, "w2", [9])
    assert await backend.complete(a1.job_id, worker_id="w2", finish_reason="length")
    events = [e async for e in backend.results(a1.job_id)]
    streamed = [t for e in events for t in e.token_ids]
    assert streamed == [7, 8, 9]
    assert events[-1].kind is EventKind.DONE
    assert events[-1].finish_reason == "length"


async def test_renewed_lease_is_not_reclaimed(backend, make_job, clock) -> None:
    await backend.enqueue(make_job("a"))
    job = await backend.dispatch("w1", LEASE_MS)
    clock.advance(LEASE_MS - 10)
    assert await backend.renew("w1", job.job_id, LEASE_MS)
    clock.advance(LEASE_MS - 10)
    assert await backend.reclaim_expired_leases() == []
    assert await backend.job_status(job.job_id) is JobStatus.LEASED


async def test_totals_count_lease_expirations_and_requeues(backend, make_job, clock) -> None:
    for _ in range(3):
        await backend.enqueue(make_job("a"))
    assert await backend.totals() == QueueTotals()
    dead = await backend.dispatch("dead", LEASE_MS)
    handed_back = await backend.dispatch("w1", LEASE_MS)
    assert await backend.requeue(handed_back.job_id, worker_id="w1")
    assert not await backend.requeue(handed_back.job_id)  # not leased: nothing counted
    clock.advance(LEASE_MS)
    assert await backend.reclaim_expired_leases() == [dead.job_id]
    assert await backend.reclaim_expired_leases() == []
    assert await backend.totals() == QueueTotals(lease_expirations=1, requeues=1)


async def test_requeue_goes_ahead_of_later_arrivals(backend, make_job) -> None:
    a1, a2 = make_job("a"), make_job("a")
    await backend.enqueue(a1)
    await backend.enqueue(a2)
    job = await backend.dispatch("w1", LEASE_MS)
    assert await backend.publish_tokens(job.job_id, "w1", [4])
    assert await backend.publish_tokens(job.job_id, "w1", [5])
    assert not await backend.requeue(job.job_id, worker_id="someone-else")
    assert await backend.requeue(job.job_id, worker_id="w1")
    again = await backend.dispatch("w1", LEASE_MS)
    # It resumes after what its result stream holds: what the client has.
    assert (again.job_id, again.resumed_token_ids) == (a1.job_id, (4, 5))
    assert await backend.publish_tokens(job.job_id, "w1", [6])
    assert await backend.requeue(job.job_id)
    assert (await backend.dispatch("w1", LEASE_MS)).resumed_token_ids == (4, 5, 6)


async def test_cancel_queued_and_leased(backend, make_job) -> None:
    queued, leased = make_job("a"), make_job("b", "priority")
    await backend.enqueue(queued)
    await backend.enqueue(leased)
    job = await backend.dispatch("w1", LEASE_MS)
    assert job.job_id == leased.job_id
    assert await backend.cancel(queued.job_id)
    assert await backend.cancel(leased.job_id)
    assert not await backend.cancel(leased.job_id)
    assert not await backend.renew("w1", leased.job_id, LEASE_MS)
    assert not await backend.publish_tokens(leased.job_id, "w1", [1])
    assert await backend.dispatch("w1", LEASE_MS) is None
    assert await backend.depth() == {}


async def test_results_resume_from_a_cursor(backend, make_job) -> None:
    await backend.enqueue(make_job("a", job_id="r1"))
    await backend.dispatch("w1", LEASE_MS)
    for token in (1, 2, 3):
        assert await backend.publish_tokens("r1", "w1", [token])
    seen = []
    async for event in backend.results("r1"):
        seen.append(event)
        if len(seen) == 2:
            break
    reader = asyncio.create_task(_collect(backend.results("r1", seen[-1].cursor)))
    await asyncio.sleep(0.01)
    assert await backend.publish_tokens("r1", "w1", [4])
    assert await backend.complete("r1", worker_id="w1")
    rest = await asyncio.wait_for(reader, 5)
    assert [t for e in rest for t in e.token_ids] == [3, 4]
    assert rest[-1].is_terminal


async def test_the_queue_wait_travels_with_an_event(backend, make_job) -> None:
    await backend.enqueue(make_job("a"))
    await backend.enqueue(make_job("a"))
    first, second = await backend.dispatch_many("w1", LEASE_MS, 2)
    assert await backend.publish_step(first.job_id, "w1", [7], queue_wait_ms=12.5)
    assert await backend.publish_step(first.job_id, "w1", [8])
    assert await backend.publish_step(first.job_id, "w1", (), finish_reason="stop")
    assert await backend.publish_step(
        second.job_id, "w1", (), finish_reason="length", queue_wait_ms=0.25
    )
    events = [e async for e in backend.results(first.job_id)]
    assert [(e.token_ids, e.queue_wait_ms) for e in events] == [
        ((7,), 12.5),
        ((8,), None),
        ((), None),
    ]
    (done,) = [e async for e in backend.results(second.job_id)]
    assert (done.kind, done.queue_wait_ms) == (EventKind.DONE, 0.25)


async def test_logprobs_travel_with_their_tokens(backend, make_job) -> None:
    await backend.enqueue(make_job("a"))
    (job,) = await backend.dispatch_many("w1", LEASE_MS, 1)
    sent = (TokenLogprob(7, -0.25, ((7, -0.25), (3, -1.5))), TokenLogprob(8, -3.0))
    assert await backend.publish_step(
        job.job_id, "w1", [7, 8], "ab", logprobs=encode_logprobs(sent)
    )
    assert await backend.publish_step(job.job_id, "w1", [9], "c", finish_reason="stop")
    first, second, done = [e async for e in backend.results(job.job_id)]
    assert decode_logprobs(first.logprobs) == (sent, None)
    assert (second.token_ids, second.logprobs) == ((9,), "")  # a step without: none stored
    assert done.kind is EventKind.DONE


async def _collect(events) -> list:
    return [e async for e in events]


async def test_enqueue_refusals(backend, make_job) -> None:
    await backend.configure_tiers([TierConfig("batch", rank=2, max_queued_jobs=2)])
    job = make_job("a", "batch")
    await backend.enqueue(job)
    with pytest.raises(DuplicateJobError):
        await backend.enqueue(job)
    await backend.enqueue(make_job("b", "batch"))
    with pytest.raises(QueueFullError) as full:
        await backend.enqueue(make_job("c", "batch"))
    assert full.value.max_queued_jobs == 2
    with pytest.raises(UnknownTierError):
        await backend.enqueue(make_job("a", "priority"))


async def test_tier_changes_take_effect_at_the_next_dispatch(backend, make_job) -> None:
    for _ in range(2):
        await backend.enqueue(make_job("a", "priority"))
        await backend.enqueue(make_job("b", "batch"))
    assert (await backend.dispatch("w1", LEASE_MS)).tier == "priority"
    await backend.configure_tiers([TierConfig("priority", rank=3), TierConfig("batch", rank=0)])
    job = await backend.dispatch("w1", LEASE_MS)
    assert (job.tier, job.rank) == ("batch", 0)
    assert [t.name for t in await backend.get_tiers()] == ["batch", "priority"]


async def test_a_removed_tier_is_forgotten_once_nothing_is_queued_in_it(
    backend, make_job, redis_client, keys
) -> None:
    temp = TierConfig("temp", rank=5)
    await backend.configure_tiers([*TIERS, temp])
    for tenant in ("a", "b"):
        await backend.enqueue(make_job(tenant, "temp", job_id=f"{tenant}-1"))
    await backend.enqueue(make_job("a", "temp", job_id="a-2"))
    for job in await backend.dispatch_many("w1", LEASE_MS, 2):
        await backend.complete(job.job_id, worker_id="w1")
    assert set(await backend.counters("temp")) == {"a", "b"}
    # Removed with a job queued: kept until it has gone.
    await backend.configure_tiers(list(TIERS))
    assert set(await backend.counters("temp")) == {"a", "b"}
    assert (await backend.dispatch("w1", LEASE_MS)).job_id == "a-2"
    await backend.configure_tiers(list(TIERS))
    assert await backend.counters("temp") == {}
    if isinstance(backend, RedisBackend):  # nothing of it is left behind
        names = [n async for n in redis_client.scan_iter(match=keys.pattern())]
        assert [n for n in names if "temp" in n] == []
    # Removed while a job of it runs: that job's charges count it anew, and the next
    # change of the tiers forgets it again.
    await backend.configure_tiers([*TIERS, temp])
    await backend.enqueue(make_job("d", "temp", job_id="d-1"))
    assert (await backend.dispatch("w1", LEASE_MS)).job_id == "d-1"
    await backend.configure_tiers(list(TIERS))
    assert await backend.charge("d-1", output_tokens=5)
    await backend.complete("d-1", worker_id="w1")
    assert set(await backend.counters("temp")) == {"d"}
    for _ in range(2):  # the first forgets its counters, the second its last trace
        await backend.configure_tiers(list(TIERS))
        assert await backend.counters("temp") == {}
    if isinstance(backend, RedisBackend):
        names = [n async for n in redis_client.scan_iter(match=keys.pattern())]
        assert [n for n in names if "temp" in n] == []
        assert "temp" not in await redis_client.hkeys(keys.floor)
    # Made again under its name, it starts afresh: its first tenant is not behind.
    await backend.configure_tiers([*TIERS, temp])
    await backend.enqueue(make_job("c", "temp", job_id="c-1"))
    assert await backend.counters("temp") == {"c": 0.0}


async def test_depth_per_tier_and_tenant(backend, make_job) -> None:
    await backend.enqueue(make_job("a", num_prompt_tokens=5, max_tokens=7))
    await backend.enqueue(make_job("a", num_prompt_tokens=3, max_tokens=1))
    await backend.enqueue(make_job("b", "batch"))
    depth = await backend.depth()
    assert depth["interactive"].num_jobs == 2
    tenant = depth["interactive"].tenants["a"]
    assert (tenant.num_jobs, tenant.num_prefill_tokens, tenant.num_decode_tokens) == (2, 8, 8)
    assert depth["batch"].num_jobs == 1


async def test_fleet_capacity_counts_live_workers(backend, clock) -> None:
    assert (await backend.fleet_capacity()).num_workers == 0
    await backend.publish_capacity(
        "w1", prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, ttl_ms=3_000
    )
    clock.advance(2_000)
    await backend.publish_capacity(
        "w2", prefill_tokens_per_s=500.0, decode_tokens_per_s=50.0, ttl_ms=3_000
    )
    fleet = await backend.fleet_capacity()
    assert (fleet.num_workers, fleet.prefill_tokens_per_s, fleet.decode_tokens_per_s) == (
        2,
        1500.0,
        150.0,
    )
    clock.advance(1_000)
    assert (await backend.fleet_capacity()).num_workers == 1


async def test_work_ahead_counts_better_tiers_and_fair_shares(backend, make_job) -> None:
    await backend.enqueue(make_job("p", "priority", num_prompt_tokens=100, max_tokens=10))
    await backend.enqueue(make_job("x", "batch", num_prompt_tokens=999))
    await backend.enqueue(make_job("a", weight=1.0, num_prompt_tokens=40, max_tokens=20))
    await backend.enqueue(make_job("b", weight=3.0, num_prompt_tokens=600, max_tokens=60))
    ahead = await backend.work_ahead("interactive", "a", 1.0, 20)
    # priority 100; own 40; b gets 3x what a receives (40 + 20) = 180 of its 600.
    assert ahead.num_prefill_tokens == pytest.approx(100 + 40 + 180)
    assert ahead.num_decode_tokens == pytest.approx(10 + 20 + 60 * 180 / 600)


async def test_memory_backend_lets_finished_results_go_after_their_ttl(make_job, clock) -> None:
    """The in-process queue's memory stays flat under sustained load: a finished job's
    result stream is kept only `finished_result_ttl_ms` (for a reader that comes back),
    while its status stays answerable."""
    from scheduler.memory_backend import MemoryBackend

    backend = MemoryBackend(clock_ms=clock, finished_result_ttl_ms=1_000)
    await backend.configure_tiers(TIERS)
    first = make_job("a")
    await backend.enqueue(first)
    await drain(backend, 1)
    again = [e async for e in backend.results(first.job_id)]  # still there to re-read
    assert [e.kind for e in again] == [EventKind.DONE]
    for _ in range(200):
        clock.advance(100)
        await backend.enqueue(make_job("a"))
        await drain(backend, 1)
    assert len(backend._streams) <= 11  # the last second's, not all 201
    assert await backend.job_status(first.job_id) is JobStatus.DONE


async def test_a_finished_job_keeps_its_status_and_id_but_not_its_prompt(
    backend, make_job, redis_client, keys
) -> None:
    """Finished jobs are kept (status, duplicate refusal) until finished_ttl_ms, an hour
    by default; their prompts are not."""
    from scheduler.memory_backend import MemoryBackend

    job = make_job("a", num_prompt_tokens=500)
    await backend.enqueue(job)
    await drain(backend, 1)
    assert await backend.job_status(job.job_id) is JobStatus.DONE
    with pytest.raises(DuplicateJobError):
        await backend.enqueue(job)
    assert await backend.charge(job.job_id, output_tokens=1)  # a late charge still counts
    if isinstance(backend, MemoryBackend):
        # Nothing of the job is kept but its status, tier, tenant, weight and max_tokens,
        # in a tuple of atomic values the garbage collector stops tracking.
        assert job.job_id not in backend._entries
        assert backend._finished[job.job_id] == (
            "done",
            job.tier,
            job.tenant_id,
            job.weight,
            job.params.max_tokens,
        )
        gc.collect()
        assert not gc.is_tracked(backend._finished[job.job_id])
    else:
        assert await redis_client.hget(keys.job(job.job_id), "j") == ""
